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


if __name__ == "__main__":
    if sys.argv[1:2] == ["baseline"]:
        baseline(sys.argv[2])
