"""Measure a tiny CPU run's peak RSS next to its baseline, for tests/plan/test_measured.py and docs/plan.md.

``python -m tests.plan.measure baseline MODEL``: the resident set after the training code's imports and the
model build (fp32), before any training: the Python/torch/transformers baseline plus the fp32 parameters. It
is the *current* RSS (/proc/self/statm), not the high-water mark: loading safetensors maps the file and the
mapped pages count in RSS while the weights are copied, a transient (about the model's size) that is gone
before training starts.
The training increment of a run = its peak_memory_mb (posttrain/train/metrics.py: ru_maxrss on CPU, recorded
with every step in metrics.jsonl) − this baseline.
"""

from __future__ import annotations

import json
import os
import sys


def baseline(model_dir: str) -> float:
    import gc

    import posttrain.train.dpo  # noqa: F401  the imports a recipe run makes
    import posttrain.train.loop  # noqa: F401
    import posttrain.train.sft  # noqa: F401
    from posttrain.models.load import load_model, load_tokenizer

    load_tokenizer(model_dir)
    model = load_model(model_dir)
    params = sum(p.numel() for p in model.parameters())
    gc.collect()
    with open("/proc/self/statm") as statm:
        rss_mb = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    print(json.dumps({"baseline_rss_mb": rss_mb, "params": params}))
    return rss_mb


def _rss_mb(field: str = "VmRSS") -> float:
    """A field of /proc/self/status in MiB (VmRSS: now; VmHWM: the high-water mark since the last reset)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def ep_sft(out_file: str, argv: list[str]) -> int:
    """``torchrun … -m tests.plan.measure ep-sft OUT.json sft OVERRIDES…``: the real ``posttrain sft`` run, with
    this rank's baseline taken right after ``parallelize`` has kept its experts (every rank loads the whole model
    first; that transient is gone by then) and the peak measured from there on: the high-water mark is reset
    (``/proc/self/clear_refs`` ← 5) and ``peak_memory_mb`` in metrics.jsonl reads VmHWM instead of ru_maxrss
    (which cannot be reset). Counts, per MoE forward, the routed copies this rank sends and the rows its local
    experts receive, the routing imbalance the planner is given. Writes ``{rank: …}`` records to OUT.json.rank."""
    import gc

    import torch

    import posttrain.train.loop as loop
    import posttrain.train.runner as runner
    from posttrain.cli import main
    from posttrain.exit_codes import exit_process
    from posttrain.train import expert_parallel

    record: dict = {"sent": [], "received": []}
    parallelize = runner.parallelize

    def measured_parallelize(root, lm, **kwargs):
        applied = parallelize(root, lm, **kwargs)
        gc.collect()
        record["load_peak_mb"] = _rss_mb("VmHWM")  # the whole model loaded on every rank, before sharding
        record["baseline_rss_mb"] = _rss_mb()
        record["local_params"] = sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                                     for p in root.parameters())
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # the peak from here on (Linux ≥ 4.0)
        return applied

    forward, local = expert_parallel.ep_experts_forward, expert_parallel.local_experts

    def counted_forward(self, hidden_states, top_k_index, top_k_weights):
        record["sent"].append(top_k_index.numel())
        return forward(self, hidden_states, top_k_index, top_k_weights)

    def counted_local(x, counts, *args, **kwargs):
        record["received"].append(int(x.shape[0]))
        return local(x, counts, *args, **kwargs)

    def peak_memory_mb() -> float:
        record.setdefault("peaks", []).append(_rss_mb("VmHWM"))
        return record["peaks"][-1]

    runner.parallelize = measured_parallelize
    loop.peak_memory_mb = peak_memory_mb
    expert_parallel.ep_experts_forward, expert_parallel.local_experts = counted_forward, counted_local
    torch.set_num_threads(1)
    code = int(main(argv) or 0)
    with open(f"{out_file}.{os.environ.get('RANK', '0')}", "w") as out:
        json.dump(record, out)
    exit_process(code)
    return code


if __name__ == "__main__":
    if sys.argv[1:2] == ["baseline"]:
        baseline(sys.argv[2])
    elif sys.argv[1:2] == ["ep-sft"]:
        ep_sft(sys.argv[2], sys.argv[3:])
