"""The YAML recipes that ship inside the package (the files next to this module), found by name.

Every place that takes a recipe file (``--config``, ``posttrain validate``, a flywheel stage's
``recipe:``) takes either a path or the name of a packaged recipe: ``sft_tiny``, ``sft_tiny.yaml``, or
``recipes/sft_tiny.yaml`` (how the repository spelled it before the recipes moved into the package).
An existing file always wins over a packaged name, so a copied and edited recipe is never shadowed.

``posttrain recipes list`` shows them; ``posttrain recipes copy NAME [DEST]`` copies one out to edit.

Recipes for real hub models (Qwen3-0.6B, Llama-3.2-1B; docs/recipes_real.md) live in ``real/`` and are named
with that prefix: ``real/qwen3_0.6b_sft`` (also ``real/qwen3_0.6b_sft.yaml`` or
``recipes/real/qwen3_0.6b_sft.yaml``).
"""

from __future__ import annotations

import difflib
from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parent
_SUFFIXES = (".yaml", ".yml")
SUBDIRS = ("real",)  # recipe folders inside the package; their recipes are named "real/<stem>"


def packaged_recipes() -> dict[str, Path]:
    """Name (the file stem; ``real/<stem>`` in ``real/``) → path of every recipe shipped in the package: the top-level
    ones sorted by name, then each subfolder's."""
    found = {path.stem: path for path in sorted(RECIPES_DIR.glob("*.yaml"))}
    for sub in SUBDIRS:
        found.update({f"{sub}/{path.stem}": path for path in sorted((RECIPES_DIR / sub).glob("*.yaml"))})
    return found


def packaged_name(text: str | Path) -> str | None:
    """The packaged-recipe name ``text`` spells (``sft_tiny``, ``sft_tiny.yaml``, ``recipes/sft_tiny.yaml``,
    ``real/qwen3_0.6b_sft``, ``recipes/real/qwen3_0.6b_sft.yaml``), if any."""
    parts = Path(text).parts
    if parts[:1] == ("recipes",):
        parts = parts[1:]
    if not 1 <= len(parts) <= 2 or (len(parts) == 2 and parts[0] not in SUBDIRS):
        return None
    name = "/".join(parts)
    for suffix in _SUFFIXES:
        name = name.removesuffix(suffix)
    return name if name in packaged_recipes() else None


def find_recipe(name_or_path: str | Path) -> Path:
    """The recipe file ``name_or_path`` means: an existing file, else a packaged recipe of that name.

    Raises FileNotFoundError naming the closest packaged recipe when it is neither.
    """
    path = Path(name_or_path)
    if path.is_file():
        return path
    name = packaged_name(name_or_path)
    if name is not None:
        return packaged_recipes()[name]
    known = list(packaged_recipes())
    stem = path.name if len(path.parts) < 2 or path.parts[-2] not in SUBDIRS else "/".join(path.parts[-2:])
    for suffix in _SUFFIXES:
        stem = stem.removesuffix(suffix)
    guess = difflib.get_close_matches(stem, known, n=1)
    hint = f"did you mean `{guess[0]}`? " if guess else ""
    raise FileNotFoundError(
        f"recipe {str(name_or_path)!r}: no such file and no packaged recipe of that name; {hint}"
        f"packaged recipes: {', '.join(known)} (see `posttrain recipes list`)"
    )
