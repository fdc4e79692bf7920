"""Rollouts under FSDP2 on 2 ranks (run by tests/rl/test_rollout.py through torchrun, gloo on CPU).

Each rank samples its share of the prompts (``prompts[rank::world]``, seeded by global index) from the
sharded policy and writes them, with the number of all-gathers each phase issued, to ``OUT/rank{r}.json``:

- ``rollouts_short`` / ``rollouts_long``: ``max_new_tokens`` 4 and 16 (what ``sample_rollouts`` gathers
  must not depend on it);
- ``naive_short`` / ``naive_long``: the same decode with only the root unsharded, so the blocks gather in
  every forward (proves the counter sees FSDP's all-gathers; their count must grow with tokens);
- ``train_before`` / ``train_after``: all-gathers of one training forward+backward before and after a
  rollout phase (the rollout must leave FSDP's training behaviour as it found it), with the loss.

    torchrun --nproc_per_node 2 -m tests.rl.fsdp_rollouts MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as torch_dist

from posttrain import dist
from posttrain.exit_codes import exit_process
from posttrain.generate import HFBackend, SamplingParams
from posttrain.models.load import load_model, load_tokenizer
from posttrain.models.logprobs import TokenLogprobModel
from posttrain.rl.rollout import rollout_batch, sample_rollouts
from posttrain.train.parallelize import parallelize

FSDP_PROMPTS = ["What is 12 plus 30?", "Hi", "Sort 3, 1, 2 to get", [{"role": "user", "content": "Reverse the word hello"}],
                "The quick brown fox jumps over the lazy dog. Which is larger, 17 or 71?"]


def fsdp_params(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(n=2, temperature=0.8, max_new_tokens=max_new_tokens, seed=11)

GATHER_NAMES = ("all_gather_single", "all_gather_into_tensor", "all_gather")
calls = {"all_gather": 0}


def count_all_gathers() -> None:
    """Count every all-gather this process issues (FSDP2 calls them through ``torch.distributed``)."""
    for name in GATHER_NAMES:
        original = getattr(torch_dist, name, None)
        if original is None:
            continue

        def counted(*args, _original=original, **kwargs):
            calls["all_gather"] += 1
            return _original(*args, **kwargs)

        setattr(torch_dist, name, counted)


def gathers_during(fn):
    before = calls["all_gather"]
    result = fn()
    return calls["all_gather"] - before, result


def naive_decode(root, lm, tokenizer, prompts, keys, params):
    """What gathering per forward looks like: root unsharded once, blocks left to FSDP's hooks. Every forward
    is then a collective, so all ranks must run the same prompts in lockstep (rank 0's here)."""
    root._get_fsdp_state()._lazy_init()
    root.unshard()
    try:
        HFBackend(lm, tokenizer).generate(prompts, params, batch_size=4, progress=False, seed_keys=keys)
    finally:
        root.reshard()


def train_step(root, tokenizer, rollouts):
    batch = rollout_batch(rollouts, tokenizer.pad_token_id, rollouts[0].temperature)
    logprobs, _ = root(batch["input_ids"], batch["labels"])
    loss = -logprobs.mean()
    loss.backward()
    root.zero_grad(set_to_none=True)
    return float(loss.detach())


def as_json(rollouts):
    return [{"prompt_key": r.prompt_key, "sample_index": r.sample_index, "completion_ids": r.completion_ids,
             "logprobs": r.logprobs, "finish_reason": r.finish_reason} for row in rollouts for r in row]


def main(model_dir: str, out_dir: str) -> int:
    torch.set_num_threads(1)
    dist.init_distributed()
    rank, world = dist.rank(), dist.world_size()
    tokenizer = load_tokenizer(model_dir)
    root = TokenLogprobModel(load_model(model_dir))
    parallelize(root, root.lm, fsdp="on", precision="fp32", cpu_offload=False,
                activation_checkpointing="full", ac_every=1)
    root.train()
    count_all_gathers()
    keys = list(range(rank, len(FSDP_PROMPTS), world))
    mine = [FSDP_PROMPTS[k] for k in keys]
    record: dict = {"rank": rank, "keys": keys}
    # First rollout phase before any training forward: the root's lazy init happens here.
    for name, new_tokens in (("short", 4), ("long", 16)):
        count, rollouts = gathers_during(lambda n=new_tokens: sample_rollouts(
            root, root.lm, tokenizer, mine, fsdp_params(n), batch_size=3, prompt_keys=keys))
        record[f"rollouts_{name}"] = {"all_gathers": count, "rollouts": as_json(rollouts)}
    record["train_mode_kept"] = root.training
    flat = [r for row in rollouts for r in row]
    record["train_before"] = dict(zip(("all_gathers", "loss"), gathers_during(lambda: train_step(root, tokenizer, flat)),
                                      strict=True))
    sample_rollouts(root, root.lm, tokenizer, mine, fsdp_params(4), batch_size=3, prompt_keys=keys)
    record["train_after"] = dict(zip(("all_gathers", "loss"), gathers_during(lambda: train_step(root, tokenizer, flat)),
                                     strict=True))
    root.eval()
    with torch.no_grad():
        for name, new_tokens in (("short", 4), ("long", 16)):
            lockstep = list(range(0, len(FSDP_PROMPTS), world))
            count, _ = gathers_during(lambda n=new_tokens, k=lockstep: naive_decode(
                root, root.lm, tokenizer, [FSDP_PROMPTS[i] for i in k], k, fsdp_params(n)))
            record[f"naive_{name}"] = {"all_gathers": count}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy()
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1], sys.argv[2]))
