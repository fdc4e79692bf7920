"""What a run tells its user: eval during training, the closing summary, warnings and errors for surprises."""

from __future__ import annotations

import json
import warnings

import pytest
import yaml

from posttrain.config.recipes import SFTRecipe
from tests.train.conftest import base_overrides, read_jsonl, run_in_process, run_subprocess


def test_eval_every_runs_the_eval_set_during_training_and_the_summary_reports_it(tiny_model_dir, sft_data, tmp_path):
    out = tmp_path / "run"
    overrides = base_overrides(tiny_model_dir, sft_data, out, **{"train.max_steps": 6, "train.eval_every": 2,
                                                                "data.eval": sft_data})
    proc = run_subprocess(overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [m for m in read_jsonl(out / "metrics.jsonl") if "eval/loss" in m]
    assert [m["step"] for m in evals] == [2, 4, 6]  # every 2 steps, and at the end
    losses = [m["eval/loss"] for m in evals]
    assert losses[-1] < losses[0]  # the eval set is the training set here: it must go down
    summary = proc.stderr[proc.stderr.index("sft finished"):]
    best = min(losses)
    assert "6 steps" in summary and f"best {best:.4f} (step {evals[losses.index(best)]['step']})" in summary
    assert f"final {losses[-1]:.4f} (step 6)" in summary
    assert "tokens/s" in summary and "peak memory" in summary and str(out / "final") in summary
    # stderr is a pipe here: progress comes as a few whole lines, not carriage-return updates.
    assert "\r" not in proc.stderr.replace("\r\n", "\n")
    assert len([line for line in proc.stderr.splitlines() if line.startswith("[posttrain] sft:")]) <= 11


def test_a_curriculum_on_data_without_tiers_is_refused(tiny_model_dir, tmp_path, capsys):
    rows = [{"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i}"}]}
            for i in range(16)]
    data = tmp_path / "untiered.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = run_in_process(base_overrides(tiny_model_dir, str(data), tmp_path / "out", **{"data.curriculum": "tiered"}))
    assert code == 2
    assert "none of the 16 records has `tier`" in capsys.readouterr().err


def test_a_partly_tiered_curriculum_warns_with_the_count(tiny_model_dir, tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i}"}],
             **({"tier": 1 + i % 3} if i % 2 else {})} for i in range(16)]
    data = tmp_path / "half.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(UserWarning, match="8 of 16 records have no `tier`"):
        assert run_in_process(base_overrides(tiny_model_dir, str(data), tmp_path / "out",
                                             **{"data.curriculum": "tiered", "train.max_steps": 2})) == 0


def test_warmup_as_long_as_the_run_warns_and_alerts(tiny_model_dir, sft_data, tmp_path):
    out = tmp_path / "run"
    with pytest.warns(UserWarning, match="warmup_steps=6 is as long as the whole run"):
        assert run_in_process(base_overrides(tiny_model_dir, sft_data, out,
                                             **{"train.max_steps": 4, "train.warmup_steps": 6})) == 0
    assert any(a["kind"] == "config_warning" for a in read_jsonl(out / "alerts.jsonl"))


def test_the_resolved_config_is_the_config_the_run_used(tiny_model_dir, sft_data, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, out, **{"train.max_steps": 2})) == 0
    resolved = SFTRecipe.model_validate(yaml.safe_load((out / "config.yaml").read_text()))
    assert resolved.train.global_batch == 4 and resolved.train.epochs is None and resolved.train.max_steps == 2
    # Run from the written config: the same run (same identity), already finished — said, not redone.
    exported = (out / "final" / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run_in_process(["--config", str(out / "config.yaml")]) == 0
    assert "holds a finished run (2 steps" in capsys.readouterr().err
    assert (out / "final" / "model.safetensors").stat().st_mtime_ns == exported


def test_a_micro_batch_bigger_than_the_global_batch_warns(tiny_model_dir, sft_data, tmp_path):
    with pytest.warns(UserWarning, match="train.batch_size=8 is more than each rank's share"):
        assert run_in_process(base_overrides(tiny_model_dir, sft_data, tmp_path / "run", **{
            "train.max_steps": 1, "train.batch_size": 8, "train.global_batch_size": 4})) == 0


def test_a_skipped_update_is_said_in_one_line_and_in_the_progress(tiny_model_dir, sft_data, tmp_path):
    out = tmp_path / "run"
    proc = run_subprocess(base_overrides(tiny_model_dir, sft_data, out, **{"train.max_steps": 5,
                                                                          "debug.nan_steps": "[2]"}))
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = [line for line in proc.stderr.splitlines() if "update skipped by the health guard" in line]
    assert len(said) == 1 and said[0].startswith("[posttrain] step 2:") and "non-finite" in said[0]
    progress = [line for line in proc.stderr.splitlines() if line.startswith("[posttrain] sft:")]
    assert progress and all("update=SKIPPED" in line for line in progress if "loss=nan" in line)
    assert any("loss=nan" in line for line in progress)
