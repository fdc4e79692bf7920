"""Expert parallelism (``parallel.expert: N``): each MoE layer's experts sharded over N ranks, tokens sent to
them with all-to-all.

Applied by ``parallelize()`` (``posttrain.train.parallelize``), never inside the model. What changes on
each rank, for every experts module of the HF model (``Qwen3MoeExperts``, ``DeepseekV3Experts``,
…: stacked weights ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``):

- the stacked weights become DTensors ``Shard(0)`` on the ``ep`` mesh dimension: the rank keeps experts
  ``[r·E/N, (r+1)·E/N)`` of its EP group, while the state dict still shows the full ``[E, …]`` tensors, so
  DCP reshards a checkpoint between any EP degree (EP=2 resumes at EP=1 and back) and the HF export is
  unchanged;
- the experts' forward is ``ep_experts_forward``: the router is untouched (replicated, a dense part),
  tokens are sorted by expert, their counts exchanged (``all_to_all_single``), the tokens sent to the
  ranks that own their experts, run through the local experts (a grouped GEMM on CUDA, one matmul pair
  per expert elsewhere), sent back, weighted by their routing weights and summed over the top-k.
  Autograd flows through both all-to-alls (``_AllToAll``: the backward is the reverse exchange), so the
  router, the experts and everything before them get the same gradients as without EP.

The device mesh (``expert_mesh``) is 2-D, ``(efsdp, ep)`` = ``(world / N, N)``: an EP group is N
consecutive ranks, and the ``world / N`` replicas of each expert shard (one per EP group) are sharded
with FSDP2 over ``efsdp``. As in torchtitan, the experts' FSDP divides gradients by the *world* size,
like the dense parts: each expert's gradient already sums the tokens of the whole EP group
(``set_gradient_divide_factor``; with SUM and a division on gloo, which has no PREMUL_SUM). The dense parts
(attention, norms, router, embeddings) are sharded with FSDP2 on the same 2-D mesh: over ``ep``, replicated
over ``efsdp`` (HSDP); at ``world == N`` (``efsdp`` of size 1) that is plain FSDP over every rank. Departure
from torchtitan, which shards the dense parts over all ranks on a mesh of their own: with one mesh for every
DTensor the loop's ``clip_grad_norm_`` and fused AdamW work unchanged (torch refuses to combine norms of
DTensors on different meshes; torchtitan has an EP-aware clip for that), at the cost of dense weights
replicated ``world / N`` times when the world is larger than an EP group.

Every rank must run the same number of MoE forwards (the exchanges are collectives): training steps do;
sampling with per-rank prompts (GRPO's in-process HF rollouts) does not, which is why GRPO takes
``parallel.expert > 1`` only with ``rollout.engine: vllm`` (posttrain/config/rl.py; its log-prob recompute
pads to the same count, posttrain/rl/offpolicy.py).
"""

from __future__ import annotations

import logging
import types

import torch
import torch.distributed as torch_dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
# Seconds spent in the token all-to-alls since the last reset (``benchmarks/moe.py`` reads it).
timings = {"all_to_all_s": 0.0, "calls": 0}


def experts_modules(lm: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules holding a layer's stacked experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``)."""
    found = []
    for module in lm.modules():
        weights = [getattr(module, name, None) for name in EXPERT_WEIGHTS]
        if all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights) and hasattr(module, "num_experts"):
            found.append(module)
    return found


def check_expert_degree(lm: torch.nn.Module, expert: int, world: int) -> list[torch.nn.Module]:
    """The experts modules to shard ``expert`` ways over ``world`` ranks; a ``ValueError`` that says what
    to set when the model is dense or the numbers do not divide."""
    if expert < 1:
        raise ValueError(f"parallel.expert={expert}: the expert-parallel degree is at least 1")
    modules = experts_modules(lm)
    if expert == 1:
        return modules
    if not modules:
        raise ValueError(f"parallel.expert={expert} but {type(lm).__name__} has no mixture-of-experts layers "
                         "(no stacked gate_up_proj/down_proj experts): set parallel.expert=1 for a dense model")
    if world % expert:
        raise ValueError(f"parallel.expert={expert} does not divide the {world} rank(s): an EP group is "
                         f"parallel.expert consecutive ranks; use a divisor of {world}")
    counts = sorted({int(m.num_experts) for m in modules})
    bad = [count for count in counts if count % expert]
    if bad:
        raise ValueError(f"parallel.expert={expert} does not divide the {bad[0]} experts of a layer: each rank "
                         f"holds experts / parallel.expert of them; use a divisor of {bad[0]}")
    return modules


def expert_mesh(world: int, expert: int, device_type: str) -> DeviceMesh:
    """The 2-D mesh ``(efsdp, ep)`` of ``(world / expert, expert)`` ranks that every parameter's DTensor lives on."""
    return init_device_mesh(device_type, (world // expert, expert), mesh_dim_names=("efsdp", "ep"))


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with autograd: the gradient goes back along the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _exchange(grad.contiguous(), in_splits, out_splits, ctx.group), None, None, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    import time

    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    start = time.perf_counter()
    torch_dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    timings["all_to_all_s"] += time.perf_counter() - start
    timings["calls"] += 1
    return out


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows ``x`` split ``in_splits`` to the group's ranks; returns the rows received, ``out_splits`` from each."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether the local experts run as one grouped GEMM (``torch._grouped_mm``): CUDA, bf16, SM80+."""
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (8, 0))


def local_experts(x: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor,
                  act, grouped: bool | None = None) -> torch.Tensor:
    """Rows ``x [S, H]`` grouped by local expert (``counts[j]`` rows for expert ``j``) through their SwiGLU
    experts ``gate_up [El, 2I, H]``, ``down [El, H, I]``; returns ``[S, H]``. ``grouped``: one grouped GEMM
    per projection (default: where ``grouped_mm_available``), else one matmul pair per expert."""
    if grouped is None:
        grouped = grouped_mm_available(x)
    if grouped and x.shape[0] > 0:
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
        return torch._grouped_mm(act(gate) * up, down.transpose(-2, -1), offs=offsets)
    outputs = []
    for j, rows in enumerate(torch.split(x, counts)):
        gate, up = torch.nn.functional.linear(rows, gate_up[j]).chunk(2, dim=-1)
        outputs.append(torch.nn.functional.linear(act(gate) * up, down[j]))
    return torch.cat(outputs) if outputs else x.new_zeros((0, down.shape[1]))


def ep_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' forward under EP: ``hidden_states [T, H]``, ``top_k_index``/``top_k_weights [T, K]``
    → ``[T, H]``, the same numbers as the HF forward over all experts (up to summation order)."""
    group, ranks = self._ep_group, self._ep_size
    num_tokens, top_k = top_k_index.shape
    num_experts = self.num_experts
    per_rank = num_experts // ranks
    gate_up, down = (w.to_local() if isinstance(w, DTensor) else w for w in (self.gate_up_proj, self.down_proj))
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, k) pairs sorted by expert, hence by destination rank
    rows = hidden_states[order // top_k]
    with torch.no_grad():
        sent = torch.bincount(flat, minlength=num_experts).to(torch.int64)
        received = torch.empty_like(sent)
        torch_dist.all_to_all_single(received, sent, group=group)  # [src rank, local expert] counts
    sent_rows, received_matrix = sent.view(ranks, per_rank), received.view(ranks, per_rank)
    in_splits = sent_rows.sum(1).tolist()
    out_splits = received_matrix.sum(1).tolist()
    got = all_to_all(rows, out_splits, in_splits, group)  # grouped by (source rank, local expert)
    # Regroup by local expert (source ranks in order within each): one grouped GEMM, or one loop over experts.
    segment = torch.repeat_interleave(torch.arange(ranks * per_rank, device=got.device),
                                      received_matrix.reshape(-1).to(got.device))
    by_expert = torch.argsort((segment % per_rank) * ranks + segment // per_rank, stable=True)
    out = local_experts(got[by_expert], received_matrix.sum(0).tolist(), gate_up, down, self.act_fn)
    back = torch.empty_like(by_expert)
    back[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
    returned = all_to_all(out[back], in_splits, out_splits, group)  # in ``order`` again
    weighted = returned * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(returned.dtype)
    unsorted = torch.empty_like(weighted).index_copy(0, order, weighted)
    return unsorted.view(num_tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def shard_experts(modules: list[torch.nn.Module], mesh: DeviceMesh) -> int:
    """Keep this rank's experts of every module as ``Shard(0)`` DTensors on ``mesh["ep"]`` and give the
    module the EP forward; returns the number of modules changed. Every rank must hold the same full
    weights (they were loaded from the same files)."""
    ep_mesh = mesh["ep"]
    ranks, coordinate = ep_mesh.size(), ep_mesh.get_local_rank()
    for module in modules:
        for name in EXPERT_WEIGHTS:
            full = getattr(module, name)
            local = full.detach().chunk(ranks, dim=0)[coordinate].clone()
            sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            setattr(module, name, torch.nn.Parameter(sharded, requires_grad=full.requires_grad))
        module._ep_group, module._ep_size = ep_mesh.get_group(), ranks
        module.forward = types.MethodType(ep_experts_forward, module)
    # Gathering an expert weight whole (export, full state dicts) is two all-gathers, one per mesh dimension,
    # and DTensor logs a warning per weight that says so: expected here, and once per export.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    return len(modules)
