"""What makes a run the same run: the rules a resume is checked against.

A run's **identity** is its resolved config without the keys that only say where it lives or how it
reports (``output_dir`` — copying or moving a run directory does not change the run —, ``store``, ``train.resume``,
``train.log_every``, ``train.keep_last``, ``metrics``, ``alerts``, ``health.stall_timeout_s``, and the drills'
``debug.crash_at_step``, ``crash_rank``, ``hang_at_step``, ``hang_rank`` and ``debug.log_unit_ids``), plus the
**model**: a SHA-256 over the files of ``model.path`` (weights, config, tokenizer) and its architecture (from
its ``config.json``), plus the **data**: a fingerprint of ``data.train`` and ``data.eval``
(``posttrain.data.storage.source_fingerprint``: every file of a file, shard set or saved dataset, local or in
an object store — content hashes on local disk, ETag and size in S3). Every
checkpoint manifest and the ``finished.json`` marker record it.

When ``output_dir`` already holds a run, ``plan_resume`` (called once, on rank 0, before any data is
read) decides:

- the model's files or architecture differ → **refuse** (``ResumeError``, exit 2): resuming would load
  weights into the wrong model (a 4-layer checkpoint into a 2-layer model loads 2 layers and drops the
  rest). The fix is a new ``output_dir``, or ``train.resume=never`` to start over in this one;
- the data's content changed (the same ``data.train`` path, other bytes; a shard added, removed or
  changed) → **refuse**: the checkpoint's data position indexes the old records, so the run would go on
  with other examples than it claims. A *moved* dataset with the same content (another path, or another
  bucket) resumes, with the usual warning about the changed key;
- ``model.lora`` switched on or off, or its ``r``, ``alpha``, ``target_modules``, ``quantize`` or ``experts`` changed →
  **refuse** as well: a LoRA checkpoint holds only the adapters, whose shapes and meaning these settings
  fix (``dropout`` may change, with the warning below);
- other config keys differ → resume, with a warning that names every changed key;
- the run already finished (``finished.json``) → nothing to do: say so and stop, instead of exporting
  again;
- ``train.resume``: ``auto`` (the default) resumes from the newest valid checkpoint when there is one;
  ``must`` refuses to start without one; ``never`` moves the previous run's files into
  ``previous-<UTC time>/`` (nothing is deleted) and starts from step 0;
- a checkpoint or ``finished.json`` whose identity cannot be read (missing, garbled, not an object) →
  **refuse**: nothing says it is this run's. ``train.resume=force`` (``--force-resume``) resumes it anyway,
  with a warning; its files are still checked against the manifest.

Which checkpoint is "valid" is ``posttrain.train.checkpoint.latest_valid_checkpoint``'s rule, with the run's
``CheckpointTrust`` (``store.signing_key``, ``train.max_steps``); each one passed over is reported to
``skipped`` (the runner raises a ``checkpoint_skipped`` alert for it).
"""

from __future__ import annotations

import json
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.store.manifest import UNSIGNED, CheckpointTrust
from posttrain.train.checkpoint import CheckpointInfo, identity_hash, latest_valid_checkpoint

FINISHED = "finished.json"
# Keys that say where a run lives, how it reports or whether to resume it, not what it trains.
# ``parallel`` (expert parallelism) is how the weights are split over the ranks: DCP reshards between degrees.
NOT_IDENTITY = ({"output_dir", "metrics", "alerts", "store", "parallel"},
                # compile, activation offload and the attention kernel change how a step runs, not what it
                # computes: a run may resume with them toggled, or on other hardware (and checkpoints from
                # before the keys existed still resume)
                {"train": {"resume", "log_every", "keep_last", "compile", "activation_offload"},
                 "model": {"attn_implementation"},
                 "health": {"stall_timeout_s"},
                 "debug": {"crash_at_step", "crash_rank", "hang_at_step", "hang_rank", "log_unit_ids"}})
# model.lora settings that fix what a checkpoint's adapter weights are (dropout does not).
LORA_KEYS = ("r", "alpha", "target_modules", "quantize", "experts")
# What a key means in a config written before it existed (model.lora.experts came later: no expert adapters).
LORA_KEY_ABSENT = {"experts": False}
ARCHITECTURE_KEYS = ("model_type", "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings")
# Files of a run directory that ``train.resume=never`` moves aside before starting over.
RUN_FILES = ("checkpoints", "final", "adapter", FINISHED, "metrics.jsonl", "alerts.jsonl", "units.jsonl", "eval.json",
             "tensorboard", "pairs.jsonl", "dropped_pairs.jsonl")


class ResumeError(ValueError):
    """The output directory holds a run this config must not resume; the message says what to do."""


def model_identity(model_path: str) -> dict[str, Any]:
    """``{"digest", "architecture"}`` of a model directory (a hub id is identified by its name)."""
    from posttrain.train.reference import model_digest

    config_path = Path(model_path) / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    return {"digest": model_digest(model_path),
            "architecture": {key: config[key] for key in ARCHITECTURE_KEYS if key in config}}


def config_identity(config_dump: dict[str, Any]) -> dict[str, Any]:
    top, nested = NOT_IDENTITY
    kept = {key: value for key, value in config_dump.items() if key not in top}
    for section, keys in nested.items():
        if isinstance(kept.get(section), dict):
            kept[section] = {key: value for key, value in kept[section].items() if key not in keys}
    return kept


DATA_KEYS = ("train", "eval")


def data_identity(data_config) -> dict[str, Any]:
    """``{"train": fingerprint, "eval": …}`` of the data files a run reads (the keys that are set).

    A source that cannot be fingerprinted (missing, unreadable) is recorded as ``{"error": …}``: the read
    that follows raises the real error on every rank, and a missing fingerprint is never compared.
    """
    from posttrain.data.storage import source_fingerprint

    identity: dict[str, Any] = {}
    for key in DATA_KEYS:
        url = getattr(data_config, key, None)
        if isinstance(url, str) and url:
            try:
                identity[key] = source_fingerprint(url)
            except Exception as exc:  # noqa: BLE001 - the data read raises it, on every rank (see above)
                identity[key] = {"error": f"{type(exc).__name__}: {exc}"}
    return identity


@dataclass
class RunIdentity:
    config: dict[str, Any]
    model: dict[str, Any]
    data: dict[str, Any] | None = None

    @classmethod
    def of(cls, config) -> RunIdentity:
        return cls(config_identity(config.model_dump(mode="json")), model_identity(config.model.path),
                   data_identity(config.data) if getattr(config, "data", None) is not None else None)

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "model": self.model, **({"data": self.data} if self.data is not None else {})}

    @property
    def hash(self) -> str:
        return identity_hash(self.to_dict())


def changed_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dumps (added and removed keys included)."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(set(old) | set(new))
        return [changed for key in keys for changed in changed_keys(old.get(key), new.get(key), f"{prefix}{key}.")]
    return [] if old == new else [prefix.rstrip(".")]


@dataclass
class ResumePlan:
    checkpoint: CheckpointInfo | None
    finished: dict[str, Any] | None
    message: str = ""
    skipped: list[tuple[str, str]] = field(default_factory=list)  # newer checkpoints passed over, and why


def _check_model(saved: dict[str, Any], current: RunIdentity, where: str, output_dir: Path) -> None:
    model = saved.get("model") or {}
    fix = (f"use a new output_dir, or train.resume=never to start over in {output_dir} (the old run is moved "
           "into previous-<time>/, nothing is deleted)")
    old_arch, new_arch = model.get("architecture") or {}, current.model["architecture"]
    if old_arch and new_arch and old_arch != new_arch:
        diff = ", ".join(f"{key} {old_arch.get(key)} → {new_arch.get(key)}" for key in changed_keys(old_arch, new_arch))
        raise ResumeError(f"{where} was written for a model of another architecture ({diff}); {fix}")
    if model.get("digest") and model["digest"] != current.model["digest"]:
        raise ResumeError(f"{where} was written with other model files than model.path={current.config['model']['path']} "
                          f"(content hash {model['digest'][:12]} ≠ {current.model['digest'][:12]}); {fix}")
    old_lora = ((saved.get("config") or {}).get("model") or {}).get("lora")
    new_lora = current.config["model"].get("lora")
    if (old_lora is None) != (new_lora is None):
        before, after = ("full fine-tuning", "LoRA") if old_lora is None else ("LoRA", "full fine-tuning")
        raise ResumeError(f"{where} was written by {before} and this run is {after} (model.lora "
                          f"{'unset' if old_lora is None else 'set'} → {'unset' if new_lora is None else 'set'}); {fix}")
    if old_lora is not None:
        changed = [key for key in LORA_KEYS
                   if old_lora.get(key, LORA_KEY_ABSENT.get(key)) != new_lora.get(key, LORA_KEY_ABSENT.get(key))]
        if changed:
            diff = ", ".join(f"model.lora.{key} {old_lora.get(key)} → {new_lora.get(key)}" for key in changed)
            raise ResumeError(f"{where} holds adapters of other LoRA settings ({diff}); {fix}")


def _check_data(saved: dict[str, Any], current: RunIdentity, where: str, output_dir: Path) -> None:
    """Refuse when a data source's content differs from what ``where`` was trained on (see the docstring)."""
    old_data, new_data = saved.get("data") or {}, current.data or {}
    for key in DATA_KEYS:
        old, new = old_data.get(key), new_data.get(key)
        if not old or not new or "digest" not in old or "digest" not in new or old["digest"] == new["digest"]:
            continue  # not recorded (an older checkpoint), not readable now (the read says why), or unchanged
        url = current.config.get("data", {}).get(key)
        raise ResumeError(f"{where} was trained on other data than data.{key}={url} holds now "
                          f"({_data_changes(old, new)}); the checkpoint's data position would point into "
                          f"other records. Restore the data, or use a new output_dir, or train.resume=never to "
                          f"start over in {output_dir} (the old run is moved into previous-<time>/)")


def _data_changes(old: dict[str, Any], new: dict[str, Any]) -> str:
    before, after = old.get("per_file"), new.get("per_file")
    if before is None or after is None:
        return f"{old.get('files')} file(s) then, {new.get('files')} now, content fingerprint changed"
    parts = []
    for label, names in (("changed", [n for n in before if n in after and before[n] != after[n]]),
                         ("added", [n for n in after if n not in before]),
                         ("removed", [n for n in before if n not in after])):
        if names:
            shown = ", ".join(sorted(names)[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            parts.append(f"{label}: {shown}")
    return "; ".join(parts) or "content fingerprint changed"


def _warn_changed(saved: dict[str, Any], current: RunIdentity, where: str) -> None:
    changed = changed_keys(saved.get("config") or {}, current.config)
    if changed:
        warnings.warn(f"resuming {where}, written with a different config: changed {', '.join(changed)}", stacklevel=3)


def readable_identity(saved: Any, where: str, force: bool) -> dict[str, Any]:
    """The identity a checkpoint or ``finished.json`` recorded, when it has the shape this module writes.

    A missing or garbled one cannot show that ``where`` belongs to this run: ``ResumeError``, unless ``force``
    (``train.resume=force``), which resumes without the model, data and config checks, with a warning.
    """
    model = saved.get("model") if isinstance(saved, dict) else None
    if (isinstance(saved, dict) and isinstance(saved.get("config"), dict) and isinstance(model, dict)
            and isinstance(model.get("architecture", {}), dict) and isinstance(model.get("digest", ""), str | None)
            and isinstance(saved.get("data", {}), dict | None)):
        return saved
    if force:
        warnings.warn(f"resuming {where} although its run identity cannot be read (train.resume=force): the model, "
                      "data and config it was written with are not checked", stacklevel=3)
        return {}
    raise ResumeError(f"{where} records no readable run identity, so nothing shows it belongs to this run (a "
                      "garbled or forged manifest?). Use a new output_dir, or, if you trust it, rerun with "
                      "--force-resume (train.resume=force)")


def move_previous_run(output_dir: Path) -> Path | None:
    """``train.resume=never``: move what an earlier run left in ``output_dir`` into ``previous-<UTC time>/``."""
    present = [output_dir / name for name in RUN_FILES if (output_dir / name).exists()]
    if not present:
        return None
    target = output_dir / time.strftime("previous-%Y%m%dT%H%M%SZ", time.gmtime())
    target.mkdir(parents=True, exist_ok=False)
    for path in present:
        shutil.move(str(path), str(target / path.name))
    return target


def _read_finished(path: Path, force: bool) -> dict[str, Any] | None:
    """``finished.json``, when there is one; a malformed one is refused like a garbled identity."""
    if not path.exists():
        return None
    try:
        finished = json.loads(path.read_bytes())
    except (ValueError, RecursionError):
        finished = None
    if isinstance(finished, dict) and isinstance(finished.get("steps"), int) and isinstance(
            finished.get("export"), str | None):
        return finished
    if force:
        warnings.warn(f"ignoring {path}, which is not a finished-run marker (train.resume=force)", stacklevel=3)
        return None
    raise ResumeError(f"{path} is not a finished-run marker posttrain wrote; remove it, or rerun with --force-resume "
                      "(train.resume=force) to ignore it")


def plan_resume(output_dir: Path, identity: RunIdentity, mode: str,
                export_exists: Callable[[str], bool] | None = None,
                latest: Callable[[], CheckpointInfo | None] | None = None,
                trust: CheckpointTrust = UNSIGNED,
                skipped: Callable[[str, str], None] | None = None) -> ResumePlan:
    """Decide how this run starts (see the module docstring); raises ``ResumeError`` to refuse.

    A remote run store answers for itself (its files are not all mirrored locally): ``export_exists(name)``,
    whether the finished run's export is still there, and ``latest()``, the checkpoint it fetched and
    verified. By default both look in ``output_dir``, where checkpoints are checked with ``trust``."""
    if mode == "never":
        moved = move_previous_run(output_dir)
        return ResumePlan(None, None, f"train.resume=never: the previous run was moved to {moved}" if moved else "")
    force = mode == "force"
    finished = _read_finished(output_dir / FINISHED, force)
    exists = export_exists or (lambda name: (output_dir / name).exists())
    if finished is not None and finished.get("export") and not exists(finished["export"]):
        finished = None  # the export was removed: resume from the last checkpoint and export again
    if finished is not None:
        where = f"the finished run in {output_dir}"
        saved = readable_identity(finished.get("identity"), where, force)
        _check_model(saved, identity, where, output_dir)
        _check_data(saved, identity, where, output_dir)
        _warn_changed(saved, identity, where)
        return ResumePlan(None, finished)
    checkpoint = latest() if latest is not None else latest_valid_checkpoint(output_dir / "checkpoints", trust, skipped)
    if checkpoint is None:
        if mode == "must":
            raise ResumeError(f"train.resume=must but {output_dir} holds no valid checkpoint to resume from")
        return ResumePlan(None, None)
    where = f"checkpoint {checkpoint.path}"
    saved = readable_identity(checkpoint.manifest.get("identity"), where, force)
    _check_model(saved, identity, where, output_dir)
    _check_data(saved, identity, where, output_dir)
    _warn_changed(saved, identity, where)
    ranks = checkpoint.manifest.get("world_size", 1)
    return ResumePlan(checkpoint, None, f"resuming from step {checkpoint.step} of {where} (written by {ranks} rank(s))")


def write_finished(output_dir: Path, identity: RunIdentity, steps: int, export: Path | None) -> None:
    """The marker a rerun reads to say "finished" instead of training or exporting again (rank 0)."""
    if export is not None:  # relative to the run directory, so a copied run directory stays consistent
        export = export.resolve().relative_to(output_dir.resolve()) if export.resolve().is_relative_to(
            output_dir.resolve()) else export.resolve()
    (output_dir / FINISHED).write_text(json.dumps(
        {"steps": steps, "export": str(export) if export else None, "time": time.time(),
         "identity": identity.to_dict()}, indent=1))
