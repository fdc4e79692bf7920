"""Whether a planned run fits its GPUs, and what would make it fit: the one-line verdict of ``posttrain plan``.

A run fits when its peak per GPU (``report.build_plan``) is at most the GPU's memory. Every number here comes
from planning the run again with one thing changed, so a suggestion cannot disagree with the memory model:

* **The smallest GPU count that fits** is searched over the counts the planner would suggest: 1 to
  ``gpus_per_node`` on one node, then whole nodes (multiples of ``gpus_per_node``), up to ``MAX_GPUS``. For
  N ≥ 2 the peak never grows with N (sharded states and a live reference fall as 1/N; the gathered unit,
  activations, logits and KV cache do not depend on N), so a binary search finds the smallest; N = 1 is tried
  on its own because nothing is gathered there. With expert parallelism only multiples of EP are counts, and
  the smallest, N = EP, is tried on its own: there each rank's experts are whole and not gathered, from 2·EP on
  they are (a constant), so past it the peak again only falls.
* **Remedies** are the other settings that lower memory and that posttrain can train with: full activation
  checkpointing (``--ac full``, ``train.activation_checkpointing=full``) and offloading (``--offload optimizer``,
  DeepSpeed-style; ``--offload params``, posttrain's ``train.cpu_offload``), alone and together. Each is planned
  at the run's GPU count, and otherwise at the smallest count where it fits. Only the useful ones are named: a
  remedy is dropped when another one changes no more (the same knobs, each no further along) and fits on no
  more GPUs; adding GPUs without changing anything counts as such a remedy.

Offloading moves state to host memory, which this verdict does not check (there is no host-memory input): each
offload remedy says how much it needs per node. The verdict compares the modelled peak with the GPU's memory
and nothing else; docs/plan.md says what the model leaves out and why a small headroom is flagged as tight.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import product

from posttrain.plan.memory import GIB
from posttrain.plan.report import PlanInputs, build_plan
from posttrain.plan.shapes import ModelShape

MAX_GPUS = 131_072  # 2^17: beyond the largest clusters built; "no count fits" means none up to here
TIGHT_FRACTION = 0.2  # docs/plan.md: the unmodelled allocator overhead measured up to ~20% above the plan
OFFLOAD_ORDER = ("none", "optimizer", "params")  # each moves more state off the GPU
AC_REMEDY = "full"


def gpu_counts(gpus_per_node: int, limit: int = MAX_GPUS, expert_parallel: int = 1) -> list[int]:
    """1 to ``gpus_per_node`` GPUs on one node, then whole nodes, up to ``limit``, in increasing order; only
    multiples of ``expert_parallel`` (EP groups are whole)."""
    counts = list(range(1, min(gpus_per_node, limit) + 1))
    counts += range(2 * gpus_per_node, limit + 1, gpus_per_node)
    return [count for count in counts if count % expert_parallel == 0]


def peak_gib(shape: ModelShape, inputs: PlanInputs) -> float:
    return build_plan(shape, inputs)["memory_bytes"]["peak_per_gpu"] / GIB


def smallest_fitting(shape: ModelShape, inputs: PlanInputs, limit: int = MAX_GPUS) -> int | None:
    """The smallest count of ``gpu_counts`` at which the run fits ``inputs.gpu_memory_gib``; None if none does."""

    def fits(gpus: int) -> bool:
        return peak_gib(shape, replace(inputs, gpus=gpus)) <= inputs.gpu_memory_gib

    counts = gpu_counts(inputs.gpus_per_node, limit, inputs.expert_parallel)
    if not counts:
        return None
    if fits(counts[0]):
        return counts[0]
    rest = counts[1:]  # the peak does not grow with the count from here on (module docstring)
    if not rest or not fits(rest[-1]):
        return None
    low, high = 0, len(rest) - 1  # rest[high] fits; find the first that does
    while low < high:
        middle = (low + high) // 2
        if fits(rest[middle]):
            high = middle
        else:
            low = middle + 1
    return rest[low]


def _changes(inputs: PlanInputs) -> list[dict[str, str]]:
    """Every combination of the remedies that go further than the run's own settings (the empty one first)."""
    acs = [inputs.ac] + ([AC_REMEDY] if inputs.ac != AC_REMEDY else [])
    offloads = list(OFFLOAD_ORDER[OFFLOAD_ORDER.index(inputs.offload):])
    changes = []
    for ac, offload in product(acs, offloads):
        change = {}
        if ac != inputs.ac:
            change["ac"] = ac
        if offload != inputs.offload:
            change["offload"] = offload
        changes.append(change)
    return changes


def _no_further(a: dict[str, str], b: dict[str, str]) -> bool:
    """Change ``a`` touches only knobs ``b`` touches, and none further along than ``b`` takes it."""
    if "ac" in a and "ac" not in b:
        return False
    if "offload" in a:
        return "offload" in b and OFFLOAD_ORDER.index(a["offload"]) <= OFFLOAD_ORDER.index(b["offload"])
    return True


def _flags(change: dict[str, str]) -> list[str]:
    return [item for knob in ("ac", "offload") if knob in change for item in (f"--{knob}", change[knob])]


def fit_verdict(shape: ModelShape, inputs: PlanInputs) -> dict:
    """``fits``, ``peak_gib``, ``headroom_gib`` (negative when it does not fit), ``min_gpus`` (the smallest count
    that fits as configured, None if none does), ``remedies`` (empty when it fits) and the one-line ``text``.

    Each remedy: ``flags`` to add, ``min_gpus`` (the smallest count where it fits), ``fits_at_gpus`` (it fits
    at the run's count) and ``host_per_node_gib`` (host memory it needs per node at the count it is named for).
    """
    memory = inputs.gpu_memory_gib
    peak = peak_gib(shape, inputs)
    fits = peak <= memory
    ways = []  # (change, smallest count, count it is named for)
    for change in _changes(inputs) if not fits else [{}]:  # a run that fits needs no remedy
        smallest = smallest_fitting(shape, replace(inputs, **change))
        if smallest is not None:
            ways.append((change, smallest, max(smallest, inputs.gpus)))
    min_gpus = next((smallest for change, smallest, _ in ways if not change), None)
    remedies = []
    if not fits:
        useful = [(change, smallest, at) for change, smallest, at in ways
                  if not any(other is not change and _no_further(other, change) and other_at <= at
                             for other, _, other_at in ways)]
        for change, smallest, at in sorted(useful, key=lambda way: (way[2], len(way[0]))):
            if not change:
                continue  # more GPUs alone: that is min_gpus
            planned = build_plan(shape, replace(inputs, gpus=at, **change))["memory_bytes"]
            remedies.append({"flags": _flags(change), "min_gpus": smallest, "fits_at_gpus": smallest <= inputs.gpus,
                             "host_per_node_gib": planned["host_per_node"] / GIB})
    verdict = {"gpu": inputs.gpu, "gpu_memory_gib": memory, "fits": fits, "peak_gib": peak,
               "headroom_gib": memory - peak, "min_gpus": min_gpus, "remedies": remedies}
    floor = None if fits or min_gpus is not None else peak_gib(
        shape, replace(inputs, gpus=gpu_counts(inputs.gpus_per_node, MAX_GPUS, inputs.expert_parallel)[-1]))
    return {**verdict, "text": _text(verdict, inputs.gpus, floor)}


def _text(verdict: dict, gpus: int, floor: float | None) -> str:
    memory, peak, gpu = verdict["gpu_memory_gib"], verdict["peak_gib"], verdict["gpu"]
    if verdict["fits"]:
        text = (f"fits with {verdict['headroom_gib']:,.1f} GiB headroom per GPU (peak {peak:,.1f} of {memory:g} GiB, "
                f"{gpu})")
        if verdict["min_gpus"] < gpus:
            text += f"; {verdict['min_gpus']:,} GPUs would fit too"
        if verdict["headroom_gib"] < TIGHT_FRACTION * memory:
            text += (f"; tight: under {TIGHT_FRACTION:.0%} headroom, about what the model leaves out (allocator, "
                     "temporaries: docs/plan.md)")
        return text
    options = []
    if verdict["min_gpus"] is not None:
        options.append(f"needs ≥ {verdict['min_gpus']:,} GPUs")
    for remedy in verdict["remedies"]:
        option = " ".join(remedy["flags"])
        if not remedy["fits_at_gpus"]:
            option += f" on ≥ {remedy['min_gpus']:,} GPUs"
        if remedy["host_per_node_gib"] > 0:
            option += f" ({remedy['host_per_node_gib']:,.0f} GiB host memory per node)"
        options.append(option)
    text = f"does not fit: peak {peak:,.1f} GiB per GPU > {memory:g} GiB ({gpu})"
    if floor is not None:
        text += (f"; no GPU count fits as configured ({floor:,.1f} GiB per GPU does not shrink with more GPUs)")
        if options:
            return text + "; fits with " + ", or ".join(options)
        return (text + "; neither --ac full nor --offload helps enough: lower --seq or --micro-batch, or shard "
                "activations too (tensor/sequence parallelism, not modelled)")
    return text + "; " + ", or ".join(options)
