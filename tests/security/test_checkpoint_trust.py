"""A checkpoint must never run code, nor make a resume write outside the run, whatever its directory holds.

Each case plants what an attacker who can write a run's directory or bucket prefix would plant — with the
manifest's sha256 and sizes recomputed ("resealed"), or with the file's entry deleted — and checks that the
payload never runs, that the checkpoint is passed over (or the run stops with exit 2 where it must), and that
an honest resume still works. Every payload is a pickle whose only effect is to create a marker file.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from tests.train.conftest import base_overrides, make_sft_jsonl, read_jsonl, run_in_process, run_subprocess

KILLED = {"train.max_steps": 6, "train.save_every": 2, "debug.crash_at_step": 4}
RESUME = {"train.max_steps": 6, "train.save_every": 2}


class Payload:
    """Unpickling this creates ``marker``: the stand-in for arbitrary code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def payload_bytes(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker))


def torch_payload_bytes(marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save({"python": Payload(marker)}, buffer)
    return buffer.getvalue()


def reseal(step_dir: Path, drop: tuple[str, ...] = ()) -> dict:
    """Recompute the manifest's sha256 and sizes over the directory's files (what a forger does)."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    names = sorted(p.name for p in step_dir.iterdir() if p.is_file() and p.name != "manifest.json")
    manifest["files"] = {n: hashlib.sha256((step_dir / n).read_bytes()).hexdigest() for n in names if n not in drop}
    manifest["sizes"] = {n: (step_dir / n).stat().st_size for n in names if n not in drop}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    return manifest


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> str:
    return str(make_sft_jsonl(tmp_path_factory.mktemp("sftdata") / "train.jsonl"))


@pytest.fixture(scope="module")
def killed_run(tiny_model_dir, sft_data, tmp_path_factory) -> Path:
    """A run killed at step 4 with its checkpoints of steps 2 and 4: what every test copies and tampers with."""
    out = tmp_path_factory.mktemp("trust") / "run"
    proc = run_subprocess(base_overrides(tiny_model_dir, sft_data, out, **KILLED))
    assert proc.returncode < 0, proc.stderr[-2000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    return out


@pytest.fixture
def run_copy(killed_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(killed_run, copy)
    return copy


def step_dir(run: Path, step: int = 4) -> Path:
    """A checkpoint of ``run``; by default its newest, the one a resume picks."""
    return run / "checkpoints" / f"step-{step:06d}"


def resume(model: str, data: str, out: Path, *extra: str) -> int:
    return run_in_process([*base_overrides(model, data, out, **RESUME), *extra])


def skipped_alerts(out: Path) -> list[dict]:
    return [a for a in read_jsonl(out / "alerts.jsonl") if a["kind"] == "checkpoint_skipped"]


def trained_steps(out: Path) -> list[int]:
    return [m["step"] for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]


# -- pickle on resume --------------------------------------------------------------------------------------
def test_a_planted_rng_pickle_never_runs_and_the_checkpoint_is_passed_over(tiny_model_dir, sft_data, run_copy,
                                                                          tmp_path):
    marker, directory = tmp_path / "pwned", step_dir(run_copy)
    for old in directory.glob("rng-rank0.*"):
        old.unlink()
    (directory / "rng-rank0.pt").write_bytes(torch_payload_bytes(marker))
    reseal(directory)
    assert resume(tiny_model_dir, sft_data, run_copy) == 0
    assert not marker.exists()
    [alert] = skipped_alerts(run_copy)
    assert "step-000004" in alert["checkpoint"] and "holds more than RNG state" in alert["reason"]
    assert "Unsupported global: GLOBAL io.open" in alert["reason"]
    assert trained_steps(run_copy)[-4:] == [2, 3, 4, 5]  # resumed from the older, untouched checkpoint


def test_a_planted_file_missing_from_the_manifest_is_an_error_not_ignored(tiny_model_dir, sft_data, run_copy,
                                                                         tmp_path):
    marker, directory = tmp_path / "pwned", step_dir(run_copy)
    (directory / "rng-rank0.pt").write_bytes(torch_payload_bytes(marker))
    reseal(directory, drop=("rng-rank0.pt",))  # "with the file's manifest entry simply deleted"
    assert resume(tiny_model_dir, sft_data, run_copy) == 0
    assert not marker.exists()
    [alert] = skipped_alerts(run_copy)
    assert "rng-rank0.pt is not in the manifest" in alert["reason"]


def test_planted_dcp_metadata_is_refused_by_the_restricted_unpickler(tiny_model_dir, sft_data, run_copy, tmp_path):
    marker, directory = tmp_path / "pwned", step_dir(run_copy)
    (directory / ".metadata").write_bytes(payload_bytes(marker))
    reseal(directory)
    assert resume(tiny_model_dir, sft_data, run_copy) == 0
    assert not marker.exists()
    [alert] = skipped_alerts(run_copy)
    assert "refers to io.open" in alert["reason"] and "refused" in alert["reason"]


def test_a_pickled_optimizer_value_in_the_shards_is_loaded_weights_only(tmp_path):
    from posttrain.store.manifest import ManifestError
    from posttrain.train.checkpoint import latest_valid_checkpoint, load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    state = {"next_step": 1, "optimizer_steps": 1, "rollbacks": 0, "skip": [], "health": {}, "source": {}}
    saved = save_checkpoint(tmp_path, 1, model, optimizer, state, {}, keep_last=2)
    # The forger rewrites the shards with DCP itself: the optimizer's lr becomes a pickled object.
    marker = tmp_path / "pwned"
    model_sd, optim_sd = get_state_dict(model, optimizer)
    optim_sd["param_groups"][0]["lr"] = Payload(marker)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(saved.path), no_dist=True)
    reseal(saved.path)
    info = latest_valid_checkpoint(tmp_path)
    assert info is not None  # its metadata and small files are well-formed: only loading finds the object
    with pytest.raises(ManifestError, match="holds more than data"):
        load_checkpoint(info, model, optimizer)
    assert not marker.exists()


# -- path traversal --------------------------------------------------------------------------------------
def test_a_local_manifest_naming_a_file_outside_the_checkpoint_is_refused(run_copy):
    from posttrain.train.checkpoint import latest_valid_checkpoint

    outside = run_copy.parent / "train.jsonl"
    outside.write_text('{"text": "not a checkpoint file"}\n')
    directory = step_dir(run_copy)
    manifest = json.loads((directory / "manifest.json").read_text())
    name = "../../../train.jsonl"
    manifest["files"][name] = hashlib.sha256(outside.read_bytes()).hexdigest()
    manifest["sizes"][name] = outside.stat().st_size
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match="leaves the checkpoint directory"):
        info = latest_valid_checkpoint(run_copy / "checkpoints")
    assert info is not None and info.step == 2  # the older, untouched checkpoint


def test_a_remote_manifest_cannot_make_the_resume_write_outside_the_mirror(s3_bucket, killed_run, tmp_path):
    from posttrain.store import RunStore

    url = f"{s3_bucket}/run"
    store = RunStore(url, tmp_path / "mirror")
    directory = step_dir(killed_run)
    for path in directory.iterdir():
        store.put_file(path, f"checkpoints/step-000004/{path.name}")
    evil = b"written by the store's owner\n"
    victim = tmp_path / "victim.txt"
    # ``mirror/checkpoints/step-000004.tmp/`` + three ``..`` is tmp_path: the fetch would write tmp_path/victim.txt.
    name = "../../../victim.txt"
    store.fs.pipe_file(f"{store.root}/checkpoints/step-000004/{name}", evil)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"][name] = hashlib.sha256(evil).hexdigest()
    manifest["sizes"][name] = len(evil)
    store.write_bytes("checkpoints/step-000004/manifest.json", json.dumps(manifest).encode())
    with pytest.warns(UserWarning, match="leaves the checkpoint directory"):
        assert store.fetch_latest() is None
    assert not victim.exists()
    # Handed the forged manifest directly, the fetch refuses it before writing a byte.
    with pytest.raises(ValueError, match="leaves the checkpoint directory"):
        store.fetch_checkpoint(4, manifest)
    assert not victim.exists()


# -- counters, sizes, shapes -------------------------------------------------------------------------------
def test_a_forged_checkpoint_past_max_steps_is_passed_over_for_the_real_one(tiny_model_dir, sft_data, run_copy):
    real = step_dir(run_copy)
    forged = step_dir(run_copy, 999_999_999)
    shutil.copytree(real, forged)
    state = json.loads((forged / "trainer.json").read_text())
    state["next_step"] = state["optimizer_steps"] = 999_999_999
    (forged / "trainer.json").write_text(json.dumps(state))
    manifest = reseal(forged)
    manifest["step"] = 999_999_999
    (forged / "manifest.json").write_text(json.dumps(manifest))
    assert resume(tiny_model_dir, sft_data, run_copy) == 0
    [alert] = skipped_alerts(run_copy)
    assert "past the run's last step (6" in alert["reason"]
    assert json.loads((run_copy / "finished.json").read_text())["steps"] == 6
    assert trained_steps(run_copy)[-2:] == [4, 5]  # resumed from the real checkpoint of step 4


def test_trainer_counters_that_disagree_with_the_checkpoint_make_it_invalid(run_copy):
    from posttrain.train.checkpoint import verify_checkpoint

    directory = step_dir(run_copy)
    state = json.loads((directory / "trainer.json").read_text())
    state["next_step"] = 1_000_000_000
    (directory / "trainer.json").write_text(json.dumps(state))
    reseal(directory)
    assert "trainer.json says step 1000000000 in the checkpoint of step 4" in verify_checkpoint(directory)


def test_a_manifest_entry_pointing_at_dev_zero_is_refused_without_reading_it(run_copy):
    from posttrain.train.checkpoint import verify_checkpoint

    directory = step_dir(run_copy)
    (directory / "zeros").symlink_to("/dev/zero")
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"]["zeros"] = "0" * 64
    (directory / "manifest.json").write_text(json.dumps(manifest))
    outcome: list[str | None] = []
    worker = threading.Thread(target=lambda: outcome.append(verify_checkpoint(directory)), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert outcome == ["file zeros is not a regular file"]  # (a hash of /dev/zero would never end)


@pytest.mark.parametrize("manifest", ["[1, 2, 3]", '{"step": 2, "files": ["a"]}', '"text"',
                                      '{"step": 2, "files": {"trainer.json": "not-a-digest"}}'])
def test_a_malformed_manifest_falls_back_to_the_previous_checkpoint(run_copy, manifest):
    from posttrain.train.checkpoint import latest_valid_checkpoint

    (step_dir(run_copy) / "manifest.json").write_text(manifest)
    with pytest.warns(UserWarning, match="skipping checkpoint .*step-000004"):
        info = latest_valid_checkpoint(run_copy / "checkpoints")
    assert info is not None and info.step == 2


def test_a_garbled_identity_is_refused_unless_forced(tiny_model_dir, sft_data, run_copy, capsys):
    directory = step_dir(run_copy)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["identity"] = "garbled"
    (directory / "manifest.json").write_text(json.dumps(manifest))
    assert resume(tiny_model_dir, sft_data, run_copy) == 2
    err = capsys.readouterr().err
    assert "no readable run identity" in err and "--force-resume" in err and "Traceback" not in err
    assert not (run_copy / "finished.json").exists()
    from posttrain.cli import main

    assert main(["sft", "--force-resume", *base_overrides(tiny_model_dir, sft_data, run_copy, **RESUME)]) == 0
    assert trained_steps(run_copy)[-2:] == [4, 5]


# -- signed manifests --------------------------------------------------------------------------------------
KEY_ENV = "POSTTRAIN_TEST_SIGNING_KEY"


def test_signed_manifests_resume_only_with_their_key(tiny_model_dir, sft_data, tmp_path, monkeypatch, capsys):
    out = tmp_path / "signed"
    monkeypatch.setenv(KEY_ENV, "a" * 32)
    signed = {**KILLED, "store.signing_key": f"env:{KEY_ENV}"}
    proc = run_subprocess(base_overrides(tiny_model_dir, sft_data, out, **signed))
    assert proc.returncode < 0, proc.stderr[-2000:]
    manifest = json.loads((step_dir(out) / "manifest.json").read_text())
    assert manifest["signature"].startswith("hmac-sha256:")
    saved = tmp_path / "saved"
    shutil.copytree(out, saved)
    key_arg = f"store.signing_key=env:{KEY_ENV}"

    monkeypatch.setenv(KEY_ENV, "b" * 32)  # another key: the store holds checkpoints it did not sign
    assert resume(tiny_model_dir, sft_data, out, key_arg) == 2
    assert "manifest signature does not match store.signing_key" in capsys.readouterr().err
    assert not (out / "finished.json").exists()

    monkeypatch.setenv(KEY_ENV, "a" * 32)  # the right key, a manifest re-hashed by someone without it
    (step_dir(out) / "trainer.json").write_text((step_dir(out) / "trainer.json").read_text().replace("}", " }", 1))
    forged = reseal(step_dir(out))
    assert forged["signature"] == manifest["signature"]  # the forger kept the old one: it covers other hashes
    assert resume(tiny_model_dir, sft_data, out, key_arg) == 2
    assert "signature does not match" in capsys.readouterr().err

    unsigned = {key: value for key, value in manifest.items() if key != "signature"}
    (step_dir(saved) / "manifest.json").write_text(json.dumps(unsigned))
    assert resume(tiny_model_dir, sft_data, saved, key_arg) == 2
    assert "manifest is not signed" in capsys.readouterr().err

    (step_dir(saved) / "manifest.json").write_text(json.dumps(manifest))
    assert resume(tiny_model_dir, sft_data, saved, key_arg) == 0  # the honest checkpoint, the right key
    assert trained_steps(saved)[-2:] == [4, 5]


def test_a_signing_key_is_a_location_never_a_value(tiny_model_dir, sft_data, tmp_path, capsys):
    assert resume(tiny_model_dir, sft_data, tmp_path / "run", "store.signing_key=hunter2hunter2hunter2") == 2
    assert "env:VAR or file:/path" in capsys.readouterr().err
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_a_remote_manifest_with_another_signature_stops_the_fetch(s3_bucket, killed_run, tmp_path, monkeypatch):
    from posttrain.store import RunStore
    from posttrain.store.manifest import CheckpointSignatureError, CheckpointTrust, sign_manifest

    url = f"{s3_bucket}/run"
    writer = RunStore(url, tmp_path / "w")
    directory = step_dir(killed_run)
    manifest = sign_manifest(json.loads((directory / "manifest.json").read_text()), b"k" * 32)
    for path in directory.iterdir():
        if path.name != "manifest.json":
            writer.put_file(path, f"checkpoints/step-000004/{path.name}")
    writer.write_bytes("checkpoints/step-000004/manifest.json", json.dumps(manifest).encode())
    assert RunStore(url, tmp_path / "ok", trust=CheckpointTrust(b"k" * 32)).fetch_latest()[0] == 4
    with pytest.raises(CheckpointSignatureError, match="does not match"):
        RunStore(url, tmp_path / "other", trust=CheckpointTrust(b"x" * 32)).fetch_latest()
    assert not (tmp_path / "other" / "checkpoints" / "step-000004").exists()
