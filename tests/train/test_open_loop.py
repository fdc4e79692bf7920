"""The open loop: a source that makes its batches from the current weights resumes bit-exact after SIGKILL."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from safetensors.torch import load_file

from tests.train.conftest import ROOT, env, read_jsonl


def run_toy(model: str, out, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "tests.train.toy_source", model, str(out), *extra]
    return subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)


def test_a_model_dependent_source_resumes_bit_exact_after_sigkill(tiny_model_dir, tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert run_toy(tiny_model_dir, whole).returncode == 0
    crashed = run_toy(tiny_model_dir, killed, "--crash-at", "4")
    assert crashed.returncode == -signal.SIGKILL
    assert not (killed / "final.safetensors").exists()
    resumed = run_toy(tiny_model_dir, killed)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert any(a["kind"] == "resumed" and a["step"] == 4 for a in read_jsonl(killed / "alerts.jsonl"))

    a, b = load_file(str(whole / "final.safetensors")), load_file(str(killed / "final.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    drawn = json.loads((whole / "drawn.json").read_text())
    assert json.loads((killed / "drawn.json").read_text()) == drawn
    # The source's state steered the run: not the same two prompts every step.
    assert len({tuple(d) for d in drawn}) > 1
    # Step 4 ran twice in the killed run (before the kill and after the resume), on the same prompts.
    units = [u for u in read_jsonl(killed / "units.jsonl")]
    by_step: dict[int, list] = {}
    for u in units:
        by_step.setdefault(u["step"], []).append(u["ids"])
    assert all(len(set(map(tuple, ids))) == 1 for ids in by_step.values())


class _SplitSource:
    """Fixed batches; ``updates`` optimizer updates per step over consecutive groups of micro-batches."""

    name = "split"

    def __init__(self, batches: list[dict], per_step: int, updates: int):
        self.batches, self.per_step, self.updates = batches, per_step, updates

    def total_steps(self) -> int:
        return len(self.batches) // self.per_step

    def next_step(self, step, model):
        from posttrain.train.source import StepBatch

        micro = self.batches[step * self.per_step : (step + 1) * self.per_step]
        size = len(micro) // self.updates
        norms = [float(sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro[u * size:(u + 1) * size]))
                 for u in range(self.updates)]
        return StepBatch(micro_batches=micro, normalizer=norms, updates=self.updates)

    def end_step(self, step, accepted, metric_sums):
        pass

    def state(self):
        return {}

    def load_state(self, state):
        pass


def test_a_step_with_two_updates_equals_two_steps_of_one(tiny_model_dir, tmp_path):
    """``StepBatch.updates``: the micro-batches split into consecutive groups, one optimizer update each."""
    import torch

    from posttrain.models.load import load_model, load_tokenizer
    from posttrain.models.logprobs import TokenLogprobModel
    from posttrain.train.health import Alerts, HealthGuard
    from posttrain.train.loop import LoopSettings, train
    from tests.train.toy_source import toy_loss

    tokenizer = load_tokenizer(tiny_model_dir)
    texts = ["Sort 3, 1, 2: 1, 2, 3.", "Uppercase dog: DOG.", "Count the letters in banana: 6.", "Say hi: hi."]
    batches = [{"input_ids": torch.tensor([ids]), "labels": torch.tensor([ids])}
               for ids in (tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts)]
    finals = {}
    for name, per_step, updates in (("two_updates", 4, 2), ("one_update", 2, 1)):
        out = tmp_path / name
        torch.manual_seed(0)
        root = TokenLogprobModel(load_model(tiny_model_dir))
        settings = LoopSettings(
            output_dir=out, lr=1e-2, lr_schedule="constant", warmup_steps=0, min_lr_ratio=0.0, weight_decay=0.0,
            betas=(0.9, 0.95), max_grad_norm=None, save_every=None, keep_last=1, log_every=1, precision="fp32",
            sharded=False, flops_per_token=6.0, peak_flops=1e12, identity={"run": name}, health=HealthGuard(enabled=False),
            alerts=Alerts(out / "alerts.jsonl"), tensorboard=False)
        assert train(root, _SplitSource(batches, per_step, updates), toy_loss, settings) == 0
        finals[name] = {k: v.detach().clone() for k, v in root.lm.state_dict().items()}
        assert settings.summary.optimizer_steps == 2
    a, b = finals["two_updates"], finals["one_update"]
    assert all(torch.equal(a[k], b[k]) for k in a)
