"""A toy step source whose batches come from the model being trained (run as a script by the tests).

Each step it picks the two prompts of a fixed pool with the highest running loss (source state that
``end_step`` updates), samples six tokens after each from the *current* weights with a generator seeded
by the step, and trains on the sampled tokens (an expert-iteration toy). Nothing of a step exists before
the step, and the step depends on everything before it — so a resume is exact only if the loop restores
the model, the optimizer and this source's state together.

    python -m tests.train.toy_source MODEL_DIR OUT_DIR [--crash-at STEP]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from posttrain.algorithms.sft import sft_loss
from posttrain.exit_codes import exit_process
from posttrain.models.load import load_model, load_tokenizer
from posttrain.models.logprobs import IGNORE_INDEX, TokenLogprobModel
from posttrain.train.checkpoint import latest_valid_checkpoint
from posttrain.train.health import Alerts, HealthGuard
from posttrain.train.loop import LoopSettings, train
from posttrain.train.source import StepBatch

PROMPTS = ["What is 12 plus 30?", "Reverse the word hello.", "Sort 3, 1, 2.", "Uppercase dog.",
           "Count the letters in banana.", "Which is larger, 17 or 71?", "Write three fruits.", "Say hi."]
NEW_TOKENS = 6


class ToySource:
    name = "toy"

    def __init__(self, tokenizer, steps: int, seed: int = 0):
        self.prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
        self.steps, self.seed = steps, seed
        self.scores = [10.0] * len(PROMPTS)  # running loss per prompt: hardest first
        self.drawn: list[list[int]] = []
        self._pending: list[int] = []

    def total_steps(self) -> int:
        return self.steps

    @torch.no_grad()
    def _sample(self, model: TokenLogprobModel, prompt: list[int], step: int, index: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 101 + index)
        ids = list(prompt)
        for _ in range(NEW_TOKENS):
            logits = model.lm(torch.tensor([ids])).logits[0, -1].float()
            ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)))
        return ids

    def next_step(self, step: int, model: torch.nn.Module) -> StepBatch:
        order = sorted(range(len(self.prompts)), key=lambda i: (-self.scores[i], i))[:2]
        self._pending = order
        micro = []
        for index in order:
            ids = self._sample(model, self.prompts[index], step, index)
            labels = [IGNORE_INDEX] * len(self.prompts[index]) + ids[len(self.prompts[index]):]
            micro.append({"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels])})
        return StepBatch(micro_batches=micro, normalizer=float(2 * NEW_TOKENS), tokens=sum(m["input_ids"].numel() for m in micro),
                         loss_tokens=2 * NEW_TOKENS, unit_ids=[str(i) for i in order])

    def end_step(self, step: int, accepted: bool, metric_sums: dict[str, float]) -> None:
        if not accepted:
            return
        step_loss = metric_sums["nll"] / (2 * NEW_TOKENS)
        for index in self._pending:
            self.scores[index] = 0.5 * self.scores[index] + 0.5 * step_loss
        self.drawn.append(list(self._pending))

    def state(self) -> dict:
        return {"scores": self.scores, "drawn": self.drawn}

    def load_state(self, state: dict) -> None:
        self.scores, self.drawn = list(state["scores"]), [list(d) for d in state["drawn"]]


def toy_loss(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
    logprobs, _ = model(batch["input_ids"], batch["labels"])
    loss = sft_loss(logprobs)
    return loss, {"nll": loss.detach()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--crash-at", type=int, default=None)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    out = Path(args.out)
    tokenizer = load_tokenizer(args.model)
    root = TokenLogprobModel(load_model(args.model))
    source = ToySource(tokenizer, args.steps)
    settings = LoopSettings(
        output_dir=out, lr=3e-3, lr_schedule="cosine", warmup_steps=1, min_lr_ratio=0.0, weight_decay=0.0,
        betas=(0.9, 0.95), max_grad_norm=1.0, save_every=2, keep_last=2, log_every=1, precision="fp32",
        sharded=False, flops_per_token=6.0, peak_flops=1e12, identity={"run": "toy"},
        health=HealthGuard(enabled=False), alerts=Alerts(out / "alerts.jsonl"), crash_at_step=args.crash_at,
        log_unit_ids=True, tensorboard=False,
        resume_from=latest_valid_checkpoint(out / "checkpoints"),  # the recipes decide this in plan_resume
    )
    code = train(root, source, toy_loss, settings)
    if code == 0:
        save_file({k: v.contiguous() for k, v in root.lm.state_dict().items()}, str(out / "final.safetensors"))
        (out / "drawn.json").write_text(json.dumps(source.drawn))
    return code


if __name__ == "__main__":
    exit_process(main())
