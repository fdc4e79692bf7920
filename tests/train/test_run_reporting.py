"""What a run tells its user: eval during training, the closing summary, warnings and errors for surprises."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import yaml

from posttrain.config.recipes import SFTRecipe
from tests.train.conftest import base_overrides, env, read_jsonl, run_in_process, run_subprocess


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


def untiered_chats(path, n: int = 16) -> str:
    rows = [{"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i}"}]}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_readme_sft_command_trains_on_untiered_chats_with_one_warning_line(tiny_model_dir, tmp_path):
    # sft_tiny's curriculum is `tiered`; a plain chat file has no `tier`: a seeded shuffle, said once.
    data, out = untiered_chats(tmp_path / "chats.jsonl"), tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "posttrain", "sft", "--config", "sft_tiny", f"model.path={tiny_model_dir}",
                           f"data.train={data}", f"output_dir={out}", "train.max_steps=4", "metrics.tensorboard=false"],
                          cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "curriculum" in line or "Warning" in line]
    assert len(said) == 1, said
    assert said[0].startswith("[posttrain] warning: ") and "none of the 16 records has `tier`" in said[0]
    assert "seeded shuffle" in said[0] and "data.curriculum=tiered_strict" in said[0]
    assert (out / "final" / "model.safetensors").is_file()


def test_tiered_strict_refuses_untiered_data_before_the_run_writes_or_loads_anything(tiny_model_dir, tmp_path, capsys):
    data, out = untiered_chats(tmp_path / "untiered.jsonl"), tmp_path / "out"
    assert run_in_process(base_overrides(tiny_model_dir, data, out, **{"data.curriculum": "tiered_strict"})) == 2
    err = capsys.readouterr().err
    assert "data.curriculum=tiered_strict but none of the 16 records has `tier`" in err
    assert "[posttrain] model " not in err and not out.exists()


def rl_prompts(path, n: int) -> str:
    path.write_text("".join(json.dumps({"prompt": f"What is {i}+1?", "answer": str(i + 1)}) + "\n" for i in range(n)))
    return str(path)


def test_data_with_no_usable_record_stops_before_the_run_writes_or_loads_anything(tiny_model_dir, tmp_path, capsys):
    data, out = rl_prompts(tmp_path / "prompts.jsonl", 6), tmp_path / "out"
    assert run_in_process(base_overrides(tiny_model_dir, data, out, **{"data.on_error": "quarantine"})) == 2
    err = capsys.readouterr().err
    assert "the training set is empty: all 6 records read were quarantined" in err
    assert "[posttrain] model " not in err and not out.exists()
    # on_error=raise: the first bad record, as the full read names it.
    assert run_in_process(base_overrides(tiny_model_dir, data, out)) == 2
    assert f"{data}:1: " in capsys.readouterr().err and not out.exists()


def test_a_file_longer_than_the_look_ahead_is_still_refused_before_the_model_loads(tiny_model_dir, tmp_path, capsys,
                                                                                  monkeypatch):
    import posttrain.data.io

    monkeypatch.setattr(posttrain.data.io, "PEEK_RECORDS", 4)  # the look before writing sees only a part
    data, out = rl_prompts(tmp_path / "prompts.jsonl", 10), tmp_path / "out"
    assert run_in_process(base_overrides(tiny_model_dir, data, out, **{"data.on_error": "quarantine"})) == 2
    err = capsys.readouterr().err
    assert "the training set is empty: all 10 records read were quarantined" in err
    assert "[posttrain] model " not in err


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


def test_metrics_jsonl_keeps_every_step_whatever_log_every(tiny_model_dir, sft_data, tmp_path):
    # log_every thins the trackers and the progress figures; metrics.jsonl is the run's record (the report's
    # curves, resume's cut_logs), so a skipped update off the log_every grid (step 4 here) is still in it.
    out = tmp_path / "run"
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, out, **{
        "train.max_steps": 7, "train.log_every": 3, "debug.nan_steps": "[4]"})) == 0
    steps = [m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]
    assert [m["step"] for m in steps] == list(range(7))
    assert [m["step"] for m in steps if m["skipped"]] == [4]
