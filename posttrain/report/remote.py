"""The report of a run that lives in object storage (``s3://bucket/run``): fetch what a report reads, not the weights.

A run with a remote ``output_dir`` keeps its metrics, alerts, config and eval results beside its checkpoints
in the store (``posttrain.store``). ``fetch_report_files`` copies the small files a report is drawn from into a
local directory with the same layout — JSON, JSON lines and YAML, leaving out checkpoints, exports, tracker
files, runs moved aside by ``train.resume=never`` and unfinished writes — so the report of the copy is the
report of the run.
"""

from __future__ import annotations

import posixpath
from pathlib import Path

from posttrain.data.storage import filesystem, storage_errors

REPORT_SUFFIXES = (".json", ".jsonl", ".yaml")
# Weights, exports and trackers' own files: a report never reads them, and they are most of a run's bytes.
SKIPPED_DIRECTORIES = frozenset({"checkpoints", "final", "adapter", "tensorboard", "wandb", "mlruns", "ref_cache"})
MAX_FILE_BYTES = 256 << 20  # a stage's data file may be large; the report reads its summaries, not its rows


# A model directory's own JSON (a flywheel stage keeps its models beside its outputs): not read either.
MODEL_FILES = frozenset({"tokenizer.json", "tokenizer_config.json", "generation_config.json",
                         "special_tokens_map.json", "vocab.json", "added_tokens.json", "adapter_config.json"})


def _wanted(relative: str, size: int | None) -> bool:
    parts = relative.split("/")
    if any(part in SKIPPED_DIRECTORIES or part.startswith("previous-") for part in parts[:-1]):
        return False
    if parts[-1] in MODEL_FILES or parts[-1].endswith(".safetensors.index.json"):
        return False
    if any(part.startswith(".") for part in parts) or ".tmp" in parts[-1]:  # hidden, or a write not committed
        return False
    return parts[-1].endswith(REPORT_SUFFIXES) and (size is None or size <= MAX_FILE_BYTES)


def fetch_report_files(url: str, into: Path) -> Path:
    """Copy the files a report of ``url`` reads into ``into``; return the local path to report on (``into``, or
    the one file when ``url`` is an eval results file)."""
    with storage_errors(url):
        fs, base = filesystem(url)
        if fs.isfile(base):
            target = into / posixpath.basename(base)
            fs.get_file(base, str(target))
            return target
        listing = fs.find(base, detail=True)
        if not listing:
            raise FileNotFoundError(f"{url}: nothing is stored under it (check the bucket and the run's prefix)")
        keys = [key for key, info in sorted(listing.items())
                if _wanted(posixpath.relpath(key, base), info.get("size"))]
        targets = [str(into / posixpath.relpath(key, base)) for key in keys]
        for target in targets:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
        if keys:  # one call: s3fs fetches the files concurrently, not one round trip after another
            fs.get(keys, targets)
    return into


def default_remote_output(url: str) -> Path:
    """``./<run name>.report.html``: a remote run's report is written here, not into the store."""
    return Path.cwd() / f"{Path(posixpath.basename(url.rstrip('/')) or 'run').stem}.report.html"
