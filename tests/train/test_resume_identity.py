"""Resume you can trust: a changed model refuses, changed keys are named, resume is announced and controllable."""

from __future__ import annotations

import shutil
import warnings

import pytest

from posttrain.models.tiny import build_tiny_model
from tests.conftest import CHAT_TEXTS
from tests.train.conftest import base_overrides, read_jsonl, run_in_process, run_subprocess

RESUMED = {"train.max_steps": 6, "train.save_every": 2}
KILLED = {**RESUMED, "debug.crash_at_step": 4}  # the drill's key is not part of the run's identity


@pytest.fixture(scope="module")
def four_layer_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("deeper") / "model"
    return str(build_tiny_model(path, texts=CHAT_TEXTS, vocab_size=400, num_layers=4, seed=0))


def killed_run(model: str, data: str, out, **extra):
    proc = run_subprocess(base_overrides(model, data, out, **{**KILLED, **extra}))
    assert proc.returncode < 0 and (out / "checkpoints" / "step-000002").exists(), proc.stderr[-2000:]


def test_another_model_in_the_same_output_dir_is_refused_with_the_fix(tiny_model_dir, four_layer_model, sft_data,
                                                                       tmp_path, capsys):
    out = tmp_path / "run"
    killed_run(four_layer_model, sft_data, out)
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, out, **{"train.max_steps": 6})) == 2
    err = capsys.readouterr().err
    assert "another architecture (num_hidden_layers 4 → 2)" in err
    assert "new output_dir" in err and "train.resume=never" in err and "Traceback" not in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before  # nothing touched
    assert not (out / "final").exists()
    # train.resume=never starts over, and keeps the old run (moved aside, nothing deleted).
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, out, **{"train.max_steps": 6,
                                                                          "train.resume": "never"})) == 0
    moved = [p for p in out.iterdir() if p.name.startswith("previous-")]
    assert len(moved) == 1 and sorted(q.name for q in (moved[0] / "checkpoints").iterdir()) == before
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl") if "loss" in m] == list(range(6))


def test_changed_model_files_of_the_same_shape_are_refused(tiny_model_dir, sft_data, tmp_path, capsys):
    out, other = tmp_path / "run", tmp_path / "same-shape"
    shutil.copytree(tiny_model_dir, other)
    killed_run(str(other), sft_data, out)
    build_tiny_model(other, texts=CHAT_TEXTS, vocab_size=400, seed=1)  # same architecture, other weights
    assert run_in_process(base_overrides(str(other), sft_data, out, **{"train.max_steps": 6})) == 2
    assert "other model files" in capsys.readouterr().err


def test_other_changed_keys_are_named_and_a_copied_run_dir_does_not_warn(tiny_model_dir, sft_data, tmp_path):
    out = tmp_path / "run"
    killed_run(tiny_model_dir, sft_data, out)
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # output_dir is not part of a run's identity
        assert run_in_process(base_overrides(tiny_model_dir, sft_data, copy, **RESUMED)) == 0
    with pytest.warns(UserWarning, match=r"changed train\.lr, train\.weight_decay$"):
        assert run_in_process(base_overrides(tiny_model_dir, sft_data, out, **{
            **RESUMED, "train.lr": 2e-3, "train.weight_decay": 0.1})) == 0


def test_resume_is_announced_and_the_metrics_hold_one_record_per_step(tiny_model_dir, sft_data, tmp_path):
    out = tmp_path / "run"
    killed_run(tiny_model_dir, sft_data, out)
    resumed = run_subprocess(base_overrides(tiny_model_dir, sft_data, out, **RESUMED))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from step 4 of checkpoint" in resumed.stderr  # step 4 ran before the kill too
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl") if "loss" in m] == list(range(6))


def test_resume_must_refuses_without_a_checkpoint(tiny_model_dir, sft_data, tmp_path, capsys):
    out = tmp_path / "empty"
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, out, **{"train.resume": "must"})) == 2
    assert "train.resume=must" in capsys.readouterr().err


def test_compile_and_activation_offload_are_not_part_of_a_runs_identity():
    """They change how a step runs, not what it computes: toggling them on resume warns about nothing."""
    from posttrain.train.identity import changed_keys, config_identity

    before = {"train": {"lr": 1e-3, "compile": False, "activation_offload": False}, "output_dir": "a"}
    after = {"train": {"lr": 1e-3, "compile": True, "activation_offload": True}, "output_dir": "b"}
    assert changed_keys(config_identity(before), config_identity(after)) == []
    after["train"]["lr"] = 2e-3
    assert changed_keys(config_identity(before), config_identity(after)) == ["train.lr"]
