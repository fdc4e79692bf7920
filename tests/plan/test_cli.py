"""``posttrain plan`` from the command line: prints the plan, writes JSON, refuses a bad preset in one line."""

from __future__ import annotations

import json
import subprocess
import sys

from posttrain.plan.memory import GIB


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "posttrain", "plan", *args], capture_output=True, text=True,
                          timeout=120)


def test_plan_prints_and_writes_json(tmp_path):
    out = tmp_path / "plan.json"
    proc = _plan("--model", "llama3-70b", "--gpus", "64", "--seq", "8192", "--ac", "full", "--recipe", "dpo",
                 "--spot-fraction", "0.5", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "memory per GPU" in proc.stdout and "goodput" in proc.stdout and "reference model" in proc.stdout
    plan = json.loads(out.read_text())
    memory = plan["memory_bytes"]
    parts = memory["sharded_states"] + memory["gathered_unit"] + memory["activations"] + memory["logits"]
    assert memory["peak_per_gpu"] == parts
    # 70.55B params × 18 B / 64 GPUs = 19.84e9 B = 18.5 GiB, as printed.
    assert f"{memory['sharded_states'] / GIB:,.1f} GiB" == "18.5 GiB" and "18.5 GiB" in proc.stdout
    assert plan["run"]["nodes"] == 8 and plan["run"]["spot_nodes"] == 4
    assert 0 < plan["run"]["goodput"] < 1


def test_grpo_adds_the_rollout_kv_cache(tmp_path):
    out = tmp_path / "plan.json"
    proc = _plan("--model", "llama3-8b", "--gpus", "8", "--recipe", "grpo", "--prompt-len", "512",
                 "--completion-len", "1024", "--rollout-batch", "8", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["memory_bytes"]["rollout_kv_cache"] == 1_610_612_736  # 1.5 GiB, by hand
    assert "rollout KV cache" in proc.stdout
    live = _plan("--model", "llama3-8b", "--gpus", "8", "--recipe", "grpo", "--reference", "live", "--json", str(out))
    assert live.returncode == 0, live.stderr
    memory = json.loads(out.read_text())["memory_bytes"]
    assert memory["reference_model"] == 2 * 8_030_261_248 / 8  # frozen bf16 params, sharded over 8
    assert "reference model (live)" in live.stdout


def test_bad_preset_is_one_line_and_exit_2():
    proc = _plan("--model", "llama3-9b", "--gpus", "8")
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "did you mean 'llama3-8b'" in proc.stderr
