"""Which values of a resolved recipe are paths on this machine that a pod cannot reach (``posttrain k8s render``).

The pods run the recipe on other machines: a model directory or data file named by a local path is not there.
Path-valued keys are found by walking the resolved config (every key whose last part ends in ``path``,
``train``, ``eval``, ``dir``, ``file``, ``input``, ``model`` …), so a key added to a schema is covered without
a list to keep up to date. A value is reachable when it is a URL (``s3://``, ``gs://``, ``hf://``, ``https://``;
not ``file://``) or could be a Hugging Face hub id (``name`` or ``org/name``, no file suffix) that is no local
file or directory.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from posttrain.k8s.options import RenderError
from posttrain.models.source import could_be_hub_id

# The last part of a dotted key whose value names a file, directory, model or module.
_PATH_KEY = re.compile(r"(path|paths|train|eval|dir|file|files|input|model|function)$")
# Written by the run inside its own pod (scratch, lost with the pod by design): a local path is what they take.
POD_SCRATCH = frozenset({
    "store.local_dir",  # the mirror of a remote output_dir, uploaded from there
    "dpo.reference_cache_dir",  # reference log-probs, recomputed when missing
    "metrics.wandb.dir",  # W&B's own files; the run's record is in output_dir and W&B
})
# A hub id is posttrain.models.source's rule (``name`` or ``namespace/name``); a data or code file is never one,
# even without a slash (``train.jsonl``).
_FILE_SUFFIX = re.compile(r"\.(jsonl|json|parquet|arrow|txt|csv|tsv|ya?ml|py|gz|zst|bz2|xz|safetensors|bin|pt)$",
                          re.IGNORECASE)


def _leaves(value: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for name, child in value.items():
            yield from _leaves(child, f"{key}.{name}" if key else str(name))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _leaves(child, f"{key}[{index}]")
    else:
        yield key, value


def is_local_path(value: str) -> bool:
    """Whether ``value`` names something on this machine's file system rather than a URL, a hub id or a bare
    name (an API's model name: ``gpt-4o-mini``)."""
    if "://" in value:
        return value.split("://", 1)[0].lower() in ("file", "local")
    if Path(value).expanduser().exists() or value.startswith(("/", "~", ".")) or _FILE_SUFFIX.search(value):
        return True
    return "/" in value and not could_be_hub_id(value)


def local_paths(config: Any) -> list[tuple[str, str]]:
    """``(dotted key, value)`` of every path-valued key of ``config`` (a pydantic model) that a pod cannot reach."""
    found = []
    for key, value in _leaves(config.model_dump(mode="json")):
        last = re.sub(r"\[\d+\]$", "", key.rsplit(".", 1)[-1])
        if not isinstance(value, str) or not value or key in POD_SCRATCH or not _PATH_KEY.search(last):
            continue
        # A Python reward given as a file (`rewards/mine.py:score`) is a path; a module name (`pkg.mod:fn`) is not.
        path = value.partition(":")[0] if last == "function" else value
        if last == "function" and not path.endswith(".py"):
            continue
        if is_local_path(path):
            found.append((key, value))
    return found


def check_pod_paths(config: Any, allow_local_paths: bool) -> None:
    """Stop (``RenderError``, one line naming every key) when the recipe names paths only this machine has; with
    ``allow_local_paths`` (paths baked into the image) keep them and say so on stderr."""
    found = local_paths(config)
    if not found:
        return
    named = ", ".join(f"{key}={value}" for key, value in found)
    if allow_local_paths:
        print(f"posttrain k8s render: --allow-local-paths: {named} are shipped as written; each must exist at that "
              "path inside the image (a relative path from its working directory, /workspace in the Dockerfile's)",
              file=sys.stderr)
        return
    raise RenderError(f"the pods cannot reach these local paths: {named}. Put each in object storage and pass its URL "
                      f"(e.g. {found[0][0]}=s3://BUCKET/...; a model may also be a hub id, org/name), or bake it "
                      "into the image and pass its in-image path with --allow-local-paths")
