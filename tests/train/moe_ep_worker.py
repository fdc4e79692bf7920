"""Expert parallelism against no EP, gradient by gradient (run by tests/train/test_expert_parallel.py on 2 ranks).

For a tiny Qwen3-MoE and a tiny DeepSeek-V3 (every rank builds the same seeded weights), this rank computes the
loss and every gradient of one batch three ways: the whole batch in one unsharded model (no EP, no FSDP), and its
half of the batch under FSDP2 with ``parallel.expert`` 1 and 2 (``parallelize``). It writes the largest
differences to ``OUT/rank{r}.json``.

    torchrun --nproc_per_node 2 -m tests.train.moe_ep_worker OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as torch_dist

from posttrain import dist
from posttrain.exit_codes import exit_process
from posttrain.train import expert_parallel
from posttrain.train.parallelize import parallelize


def tiny_moe(arch: str) -> torch.nn.Module:
    """A 2-layer, 32-wide MoE with 4 experts, top-2; expert and router weights drawn wide enough that the
    routing is far from uniform (the default init makes every router logit ~0)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config, Qwen3MoeConfig

    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                  num_attention_heads=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64)
    if arch == "qwen3_moe":
        config = Qwen3MoeConfig(**common, num_key_value_heads=2, head_dim=8, num_experts=4)
    else:
        config = DeepseekV3Config(**common, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, n_group=1,
                                  topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8,
                                  qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, rope_scaling=None)
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(config)
    lm.config.use_cache = False
    with torch.no_grad():
        for name, param in lm.named_parameters():
            if param.dim() == 3:
                param.normal_(0, 0.1)
            elif name.endswith("gate.weight"):
                param.normal_(0, 0.5)
    return lm


class Root(torch.nn.Module):
    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=ids).loss


def compare(arch: str, ids: torch.Tensor) -> dict:
    rank, world = dist.rank(), dist.world_size()
    reference = Root(tiny_moe(arch))
    reference_loss = reference(ids)
    reference_loss.backward()
    expected = {name: param.grad for name, param in reference.named_parameters()}
    result: dict = {}
    for expert in (1, 2):
        expert_parallel.timings["calls"] = 0
        root = Root(tiny_moe(arch))
        applied = parallelize(root, root.lm, fsdp="on", precision="fp32", cpu_offload=False,
                              activation_checkpointing="full" if expert == 2 else "none", ac_every=1, expert=expert)
        loss = root(ids[rank::world])  # equal halves without padding: the mean of the halves' means is the mean
        loss.backward()  # the loop's (loss / world) * world: FSDP averages over the ranks
        total = loss.detach().clone()
        torch_dist.all_reduce(total)
        grads = {name.replace("_checkpoint_wrapped_module.", ""): param.grad.full_tensor()
                 for name, param in root.named_parameters()}
        assert grads.keys() == expected.keys()
        result[f"ep{expert}"] = {
            "ep_layers": applied["ep_layers"],
            "loss_diff": abs(float(total) / world - float(reference_loss)),
            "grad_diff": max(float((grads[k] - expected[k]).abs().max()) for k in grads),
            "grad_scale": max(float(g.abs().max()) for g in expected.values()),
            "all_to_all_calls": expert_parallel.timings["calls"],
        }
    return result


def main(out_dir: str) -> int:
    torch.set_num_threads(1)
    dist.init_distributed()
    ids = torch.randint(0, 96, (4, 12), generator=torch.Generator().manual_seed(1))
    record = {arch: compare(arch, ids) for arch in ("qwen3_moe", "deepseek_v3")}
    Path(out_dir, f"rank{dist.rank()}.json").write_text(json.dumps(record))
    dist.destroy()
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1]))
