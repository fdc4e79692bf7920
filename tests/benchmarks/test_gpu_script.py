"""benchmarks/gpu.py: its FLOP formulas against hand counts, and ``--smoke`` end to end on CPU.

The GPU figures themselves need the GPU machine; here the script must run, keep its JSON schema and
count the work it divides by time correctly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gpu
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_causal_segment_pairs_hand_count():
    # Segments of 3 and 2 tokens: query k of a segment sees k keys -> (1+2+3) + (1+2) = 9, nothing across.
    assert gpu.causal_segment_pairs([3, 2]) == 9
    assert gpu.causal_segment_pairs([5]) == 15  # one segment of 5: 1+2+3+4+5
    assert gpu.causal_segment_pairs([]) == 0


def test_prefix_shared_pairs_hand_count():
    # Prompt 2, chosen 1, rejected 2. Prompt: 1+2 = 3. Chosen token: 2 prompt keys + itself = 3.
    # Rejected tokens: (2 + 1) + (2 + 2) = 7. Total 13; two unshared rows would be (3+1)·... = 6+10 = 16.
    assert gpu.prefix_shared_pairs(2, 1, 2) == 13
    assert gpu.causal_segment_pairs([3, 4]) == 16


def test_segments_from_positions_drops_padding():
    # Two examples (3, 2 tokens) and two padding tokens (id 0) that restart at position 0.
    positions = [0, 1, 2, 0, 1, 0, 1]
    ids = [5, 6, 7, 8, 9, 0, 0]
    assert gpu.segments_from_positions(positions, ids, pad_id=0) == [3, 2]
    assert gpu.segments_from_positions(positions, ids, pad_id=None) == [3, 2, 2]


def test_flop_params_and_step_flops_hand_computed():
    # hidden 4, intermediate 8, 1 layer, 2 heads of 2, 1 KV head, vocab 10.
    # Block: Wq 4·4 + Wo 4·4 + Wk 4·2 + Wv 4·2 = 48; MLP 3·4·8 = 96; norms 2·4 = 8 -> 152.
    # N = 152 + final norm 4 + head 10·4 = 196 (the embedding lookup is not counted).
    n = gpu.flop_params(hidden=4, intermediate=8, layers=1, heads=2, kv_heads=1, vocab=10)
    assert n == 196
    # Packed row of segments 3 and 2: T = 5, P = 9 -> 6·196·5 + 12·1·4·9 = 5880 + 432.
    assert gpu.step_flops(n, layers=1, attention_width=4, tokens=5, attention_pairs=9) == 6312.0
    # 6312 FLOPs in 2 s on a 1000 FLOP/s card: 3.156.
    assert gpu.mfu(6312.0, 2.0, 1000.0) == pytest.approx(3.156)


def test_llama3_8b_shape_counts():
    # Meta's 8.03B includes the input embedding (128256·4096 = 525.3M); N excludes it.
    shape = gpu.SHAPES["8b"]
    n = gpu.flop_params(shape["hidden_size"], shape["intermediate_size"], shape["num_layers"], shape["num_heads"],
                        shape["num_kv_heads"], shape["model_vocab_size"])
    assert n + 128256 * 4096 == 8_030_261_248


@pytest.mark.slow
def test_smoke_runs_rows_and_prints_one_json_line(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--work-dir", str(tmp_path / "work"),
         "--out", str(out), "--rows", "sft-smoke,dpo-smoke,sft-smoke-liger,moe-grouped-gemm"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert report == json.loads(out.read_text())
    assert report["smoke"] is True
    assert report["machine"]["peak"]["device"] == "cpu" and report["machine"]["peak_tflops"] > 0
    rows = {r["name"]: r for r in report["rows"]}
    assert set(rows) == {"sft-smoke", "dpo-smoke", "sft-smoke-liger", "moe-grouped-gemm"}
    # a script row keeps the other benchmark's own line (on CPU the grouped GEMM says why it did not run)
    assert rows["moe-grouped-gemm"]["status"] == "skipped"
    assert rows["moe-grouped-gemm"]["result"]["benchmark"] == "moe_grouped_gemm"
    for name in ("sft-smoke", "dpo-smoke"):
        row = rows[name]
        assert row["status"] == "ok", row
        assert row["token_match"] is True  # every timed step's micro-batches were found and counted
        # median_step_s is rounded to 0.1 ms in the JSON: a 20 ms smoke step carries up to 0.5% of rounding
        assert row["tokens_per_s"] == pytest.approx(row["tokens_per_step"] / row["median_step_s"], rel=1e-2)
        assert 0 < row["mfu"] == pytest.approx(
            row["flops_per_step"] / (row["median_step_s"] * report["machine"]["peak_tflops"] * 1e12), rel=1e-2)
        assert row["plan_peak_gib"] > 0 and "peak_vs_plan" not in row  # no device memory on CPU: no ratio
    assert rows["dpo-smoke"]["reference_pass_s"] > 0
    liger = rows["sft-smoke-liger"]
    assert liger["status"] in ("ok", "skipped")
    if liger["status"] == "skipped":
        assert "model.liger" in liger["reason"]
