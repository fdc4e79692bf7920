"""The quickstart's base model, pretrained once and shipped with posttrain.

Round 1 of the quickstart starts from a 1.3M-parameter Llama pretrained on the built-in task text. Making it
takes ~50 s on 2 cores, a sixth of ``make demo``, and gives the same model every time on a given machine, so
posttrain ships the one ``scripts/make_quickstart_base.py`` made (``packaged_base/``: weights, tokenizer,
its pretraining loss curve and ``provenance.json``).

The shipped model is used only when this run's base would be made from exactly the inputs it was made from:
``base_identity`` hashes the architecture, the seed, the *resolved* pretraining config (the recipe's YAML with
its overrides, every key but the run's paths) and the bytes of the corpus and of the raw pool the tokenizer is
trained on. Any difference — another seed, pool size, pretraining step count, a changed corpus generator —
and the base is pretrained here as before; ``base.packaged: false`` always pretrains. The run's log and
report say which happened. What the hash cannot see is a change to the pretraining *code*: whoever changes
numerics there reruns the script (``tests/flywheel/test_packaged_base.py`` checks the inputs still match).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from posttrain.flywheel.config import FlywheelRecipe
from posttrain.flywheel.stages import stable_hash

PACKAGED_DIR = Path(__file__).with_name("packaged_base")
PROVENANCE = "provenance.json"
METRICS = "metrics.jsonl"
PRETRAINED_ON = "PRETRAINED_ON.txt"  # the corpus path the exporter records: the run's own, written on install
# The run's own paths in the pretraining config: where it reads and writes, not what it trains.
WIRING_KEYS = {"model.path": "<init>", "data.train": "<corpus>", "output_dir": "<out>"}


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def base_inputs(config: FlywheelRecipe, data: dict[str, Any]) -> dict[str, Any]:
    """Everything the pretrained base is a function of, as recorded in ``provenance.json``: the architecture,
    the seed, the resolved pretraining config without the run's paths, and the corpus and pool bytes."""
    from posttrain.flywheel.overrides import stage_config

    spec = config.base
    assert spec.pretrain is not None  # a base pretrained here has a pretrain recipe (BaseModelSpec checks)
    pretrain = stage_config("pretrain", "base.pretrain", spec.pretrain.recipe, spec.pretrain.overrides,
                            WIRING_KEYS).model_dump(mode="json")
    return {
        "architecture": {"hidden_size": spec.hidden_size, "layers": spec.layers, "heads": spec.heads,
                         "kv_heads": spec.kv_heads, "vocab_size": spec.vocab_size},
        "seed": config.seed,
        "pretrain": pretrain,
        "corpus_sha256": file_sha256(data["corpus"]),
        "pool_sha256": file_sha256(data["raw"]),
    }


def base_identity(config: FlywheelRecipe, data: dict[str, Any]) -> str:
    return stable_hash(base_inputs(config, data))


def packaged_provenance(directory: Path = PACKAGED_DIR) -> dict[str, Any] | None:
    path = directory / PROVENANCE
    return json.loads(path.read_text()) if path.exists() else None


def matching_packaged_base(config: FlywheelRecipe, data: dict[str, Any],
                           directory: Path = PACKAGED_DIR) -> dict[str, Any] | None:
    """The shipped base's provenance when this run would pretrain exactly it (``base.packaged`` on, no user
    model, same identity); else ``None``: pretrain here."""
    if config.base.model is not None or not config.base.packaged:
        return None
    provenance = packaged_provenance(directory)
    if provenance is None or provenance.get("identity") != base_identity(config, data):
        return None
    return provenance


def write_packaged_base(config: FlywheelRecipe, data: dict[str, Any], base: dict[str, Any], made_by: dict[str, Any],
                        directory: Path = PACKAGED_DIR) -> dict[str, Any]:
    """Ship the base that ``stage_base`` just pretrained (its outputs ``base``) into ``directory``, replacing what
    was there: the model and tokenizer, its loss curve, and ``provenance.json`` (identity, inputs, ``made_by``)."""
    losses = [row["loss"] for row in map(json.loads, Path(base["metrics"]).read_text().splitlines()) if "loss" in row]
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    for path in sorted(Path(base["model"]).iterdir()):
        if path.name != PRETRAINED_ON and path.is_file():  # names the maker's corpus path; install writes the run's
            shutil.copyfile(path, directory / path.name)
    shutil.copyfile(base["metrics"], directory / METRICS)
    inputs = base_inputs(config, data)
    provenance = {"identity": stable_hash(inputs), "inputs": inputs, "made_by": made_by,
                  "loss": {"steps": len(losses), "first": round(losses[0], 4), "last": round(losses[-1], 4)}}
    (directory / PROVENANCE).write_text(json.dumps(provenance, indent=1) + "\n")
    return provenance


def install_packaged_base(provenance: dict[str, Any], corpus: str, out: Path,
                          directory: Path = PACKAGED_DIR) -> dict[str, Any]:
    """Copy the shipped base into the base stage's directory where pretraining would have put it
    (``pretrain/final``, ``pretrain/metrics.jsonl``), so the run directory stays self-contained; its
    ``PRETRAINED_ON.txt`` names this run's ``corpus``, byte for byte the one it was pretrained on."""
    final = out / "pretrain" / "final"
    final.mkdir(parents=True, exist_ok=True)
    for path in sorted(directory.iterdir()):
        if path.name == METRICS:
            shutil.copyfile(path, out / "pretrain" / METRICS)
        elif path.name != PROVENANCE and path.is_file():
            shutil.copyfile(path, final / path.name)
    (final / PRETRAINED_ON).write_text(f"{corpus}\n")
    shutil.copyfile(directory / PROVENANCE, out / PROVENANCE)
    made = provenance["made_by"]
    note = (f"the packaged quickstart base ({made['command']}, {made['date']}): pretrained from exactly this "
            f"run's inputs (identity {provenance['identity']}); base.packaged: false pretrains it here")
    print(f"[flywheel] base: {note}", file=sys.stderr, flush=True)
    return {"model": str(final), "metrics": str(out / "pretrain" / METRICS), "packaged": note}
