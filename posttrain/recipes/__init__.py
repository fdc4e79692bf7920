"""The YAML recipes that ship inside the package (the files next to this module), found by name.

Every place that takes a recipe file (``--config``, ``posttrain validate``, a flywheel stage's
``recipe:``) takes either a path or the name of a packaged recipe: ``sft_tiny``, ``sft_tiny.yaml``, or
``recipes/sft_tiny.yaml`` (how the repository spelled it before the recipes moved into the package).
An existing file always wins over a packaged name, so a copied and edited recipe is never shadowed.

``posttrain recipes list`` shows them; ``posttrain recipes copy NAME [DEST]`` copies one out to edit.
"""

from __future__ import annotations

import difflib
from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parent
_SUFFIXES = (".yaml", ".yml")


def packaged_recipes() -> dict[str, Path]:
    """Name (the file stem) → path of every recipe shipped in the package, sorted by name."""
    return {path.stem: path for path in sorted(RECIPES_DIR.glob("*.yaml"))}


def packaged_name(text: str | Path) -> str | None:
    """The packaged-recipe name ``text`` spells (``sft_tiny``, ``sft_tiny.yaml``, ``recipes/sft_tiny.yaml``), if any."""
    path = Path(text)
    if len(path.parts) > 2 or (len(path.parts) == 2 and path.parts[0] != "recipes"):
        return None
    name = path.name
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
    stem = path.name
    for suffix in _SUFFIXES:
        stem = stem.removesuffix(suffix)
    guess = difflib.get_close_matches(stem, known, n=1)
    hint = f"did you mean `{guess[0]}`? " if guess else ""
    raise FileNotFoundError(
        f"recipe {str(name_or_path)!r}: no such file and no packaged recipe of that name; {hint}"
        f"packaged recipes: {', '.join(known)} (see `posttrain recipes list`)"
    )
