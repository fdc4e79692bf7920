"""``posttrain plan`` says whether a run fits its GPUs, and what would make it fit (issue 25, item 2).

Driven through the real CLI (``posttrain.cli.main``); every remedy and GPU count the verdict names is planned
again to check that it does fit, so the suggestions cannot drift from the memory model.
"""

from __future__ import annotations

import json
import re

import pytest

from posttrain.cli import build_parser, main
from posttrain.plan.memory import GIB


def _plan(capsys, tmp_path, *flags: str, code: int = 0) -> tuple[str, dict]:
    """Run ``posttrain plan FLAGS --json`` and return (stdout, the plan written); the exit code must be ``code``."""
    out = tmp_path / f"plan-{len(list(tmp_path.glob('plan-*')))}.json"
    assert main(["plan", *flags, "--json", str(out)]) == code
    return capsys.readouterr().out, json.loads(out.read_text())


def _verdict_line(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith("verdict: ")]
    assert len(lines) == 1, stdout
    return lines[0]


def _fits(capsys, tmp_path, *flags: str) -> bool:
    stdout, plan = _plan(capsys, tmp_path, *flags)
    line = _verdict_line(stdout)
    assert line.startswith("verdict: fits with") == plan["verdict"]["fits"], line
    return plan["verdict"]["fits"]


def test_1t_on_256_gpus_does_not_fit_and_the_suggested_minimum_does(capsys, tmp_path):
    # As the README runs it (--ac full): 8 GiB-per-shard states need more GPUs than 256.
    base = ("--model", "dense-1t", "--seq", "4096", "--ac", "full")
    stdout, plan = _plan(capsys, tmp_path, *base, "--gpus", "256")
    line, verdict = _verdict_line(stdout), plan["verdict"]
    assert line.startswith("verdict: does not fit") and not verdict["fits"]
    assert verdict["headroom_gib"] == pytest.approx(80 - plan["memory_bytes"]["peak_per_gpu"] / GIB, abs=1e-6)
    assert verdict["headroom_gib"] < 0
    minimum = verdict["min_gpus"]
    assert f"needs ≥ {minimum:,} GPUs" in line
    assert minimum > 256 and minimum % 8 == 0  # whole nodes of --gpus-per-node 8
    assert _fits(capsys, tmp_path, *base, "--gpus", str(minimum))
    assert not _fits(capsys, tmp_path, *base, "--gpus", str(minimum - 8))  # and it is the smallest
    # Every remedy named fits at 256 GPUs (or at the count it names), and it is printed on the line.
    assert verdict["remedies"]
    for remedy in verdict["remedies"]:
        assert " ".join(remedy["flags"]) in line
        assert _fits(capsys, tmp_path, *base, "--gpus", str(max(256, remedy["min_gpus"])), *remedy["flags"])


def test_1t_with_selective_ac_fits_no_gpu_count_and_says_what_does(capsys, tmp_path):
    """The issue's command as typed: 604 GiB of activations per GPU, whatever the GPU count."""
    stdout, plan = _plan(capsys, tmp_path, "--model", "dense-1t", "--gpus", "256")
    line, verdict = _verdict_line(stdout), plan["verdict"]
    assert line.startswith("verdict: does not fit") and verdict["min_gpus"] is None
    assert "no GPU count fits as configured" in line
    by_flags = {" ".join(remedy["flags"]): remedy for remedy in verdict["remedies"]}
    assert "--offload optimizer" not in by_flags and "--offload params" not in by_flags  # they cannot help
    full = by_flags["--ac full"]
    assert f"--ac full on ≥ {full['min_gpus']:,} GPUs" in line
    assert _fits(capsys, tmp_path, "--model", "dense-1t", "--gpus", str(full["min_gpus"]), "--ac", "full")
    for remedy in verdict["remedies"]:
        gpus = max(256, remedy["min_gpus"])
        assert _fits(capsys, tmp_path, "--model", "dense-1t", "--gpus", str(gpus), *remedy["flags"])


def test_small_model_on_h100_fits_with_positive_headroom(capsys, tmp_path):
    stdout, plan = _plan(capsys, tmp_path, "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100")
    verdict = plan["verdict"]
    peak_gib = plan["memory_bytes"]["peak_per_gpu"] / GIB
    assert verdict["fits"] and verdict["headroom_gib"] == pytest.approx(80 - peak_gib) and verdict["headroom_gib"] > 0
    assert _verdict_line(stdout).startswith(f"verdict: fits with {verdict['headroom_gib']:,.1f} GiB headroom per GPU")
    assert verdict["remedies"] == [] and 1 <= verdict["min_gpus"] <= 8


@pytest.mark.parametrize(("flags", "fits"), [
    (("--model", "dense-1t", "--gpus", "256"), False),
    (("--model", "llama3-8b", "--gpus", "8"), True),
])
def test_check_exits_3_only_when_it_does_not_fit(capsys, tmp_path, flags, fits):
    _, plan = _plan(capsys, tmp_path, *flags, "--check", code=0 if fits else 3)
    assert plan["verdict"]["fits"] is fits  # the JSON is written before the exit
    _plan(capsys, tmp_path, *flags)  # without --check the verdict is printed and the exit is 0


def test_help_documents_exit_3():
    text = " ".join(build_parser()._subparsers._group_actions[0].choices["plan"].format_help().split())
    assert re.search(r"3 .*does not fit", text) and "--check" in text and "--gpu-memory" in text


@pytest.mark.parametrize(("gpu", "memory", "tflops", "hbm"), [
    ("h100", 80, 989, 3.35), ("h200", 141, 989, 4.8), ("a100-80g", 80, 312, 2.0), ("b200", 180, 2250, 8.0)])
def test_gpu_presets_set_memory_tflops_and_bandwidth(capsys, tmp_path, gpu, memory, tflops, hbm):
    stdout, plan = _plan(capsys, tmp_path, "--model", "llama3-8b", "--gpus", "8", "--gpu", gpu)
    inputs = plan["inputs"]
    assert (inputs["gpu"], inputs["gpu_memory_gib"], inputs["peak_tflops"], inputs["hbm_tbps"]) == (
        gpu, memory, tflops, hbm)
    assert f"GPU {gpu}: {memory:g} GiB, {tflops:g} TFLOP/s bf16 dense, {hbm:g} TB/s HBM" in stdout
    assert plan["verdict"]["headroom_gib"] == pytest.approx(memory - plan["memory_bytes"]["peak_per_gpu"] / GIB)


def test_explicit_flags_override_the_preset_and_change_the_verdict(capsys, tmp_path):
    # Llama-3 8B at seq 16384 on 8 GPUs: ~122 GiB per GPU, over an H100's 80 and under an H200's 141.
    run = ("--model", "llama3-8b", "--gpus", "8", "--seq", "16384")
    assert not _fits(capsys, tmp_path, *run, "--gpu", "h100")
    assert _fits(capsys, tmp_path, *run, "--gpu", "h200")
    stdout, plan = _plan(capsys, tmp_path, *run, "--gpu", "h100", "--gpu-memory", "141", "--peak-tflops", "500",
                         "--hbm-tbps", "1.5")
    inputs = plan["inputs"]
    assert (inputs["gpu_memory_gib"], inputs["peak_tflops"], inputs["hbm_tbps"]) == (141, 500, 1.5)
    assert plan["verdict"]["fits"]
    # The explicit peak, not the preset's, sets the compute time: half the FLOP/s, twice the seconds.
    _, h100 = _plan(capsys, tmp_path, *run, "--gpu", "h100")
    compute = plan["communication_per_microbatch"]["compute_seconds"]
    assert compute == pytest.approx(h100["communication_per_microbatch"]["compute_seconds"] * 989 / 500)
    assert "overridden: --gpu-memory, --peak-tflops, --hbm-tbps" in stdout
    # --gpu-memory alone keeps the default preset's other figures.
    _, alone = _plan(capsys, tmp_path, *run, "--gpu-memory", "96")
    assert (alone["inputs"]["gpu_memory_gib"], alone["inputs"]["peak_tflops"]) == (96, 989)


def test_seq_sets_the_grpo_sequence(capsys, tmp_path):
    """GRPO's sequence is prompt + completion (train.max_length holds rl.max_new_tokens): --seq is that total."""
    grpo = ("--model", "llama3-8b", "--gpus", "8", "--recipe", "grpo")
    short_out, short = _plan(capsys, tmp_path, *grpo, "--seq", "2048")
    long_out, long = _plan(capsys, tmp_path, *grpo, "--seq", "8192")
    assert "seq 2048 (prompt 1024 + completion 1024)" in short_out.splitlines()[0]
    assert "seq 8192 (prompt 7168 + completion 1024)" in long_out.splitlines()[0]
    assert (long["inputs"]["seq"], long["inputs"]["prompt_len"], long["inputs"]["completion_len"]) == (8192, 7168, 1024)
    for part in ("activations", "rollout_kv_cache", "peak_per_gpu"):
        assert long["memory_bytes"][part] > short["memory_bytes"][part], part
    assert long["memory_bytes"]["rollout_kv_cache"] == 4 * short["memory_bytes"]["rollout_kv_cache"]
    # --seq with --completion-len splits the same total differently; with --prompt-len, the completion is the rest.
    _, split = _plan(capsys, tmp_path, *grpo, "--seq", "8192", "--completion-len", "4096")
    assert (split["inputs"]["prompt_len"], split["inputs"]["completion_len"]) == (4096, 4096)
    _, split = _plan(capsys, tmp_path, *grpo, "--seq", "8192", "--prompt-len", "1000")
    assert (split["inputs"]["prompt_len"], split["inputs"]["completion_len"]) == (1000, 7192)


@pytest.mark.parametrize(("flags", "message"), [
    (("--recipe", "grpo", "--seq", "1024"), "leaves no room for the prompt"),
    (("--recipe", "grpo", "--seq", "4096", "--prompt-len", "512", "--completion-len", "1024"), "= 1536; give two of the three"),
    (("--recipe", "sft", "--completion-len", "256"), "apply to --recipe grpo only"),
])
def test_inconsistent_or_ignored_lengths_are_refused(capsys, flags, message):
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()  # the CLI's form for bad input: a header, one line each
    assert lines[0] == "posttrain: invalid config" and len(lines) == 2 and message in lines[1]


@pytest.mark.parametrize(("model", "changes"), [
    ("llama3-70b", {"ac": "full"}),
    ("llama3-70b", {"offload": "optimizer", "ac": "full", "seq": 8192}),
    ("llama3-8b", {"recipe": "grpo", "reference": "live"}),
    ("llama3-8b", {"offload": "params", "seq": 8192}),  # nothing is sharded on the GPU: 1 GPU may be the answer
    ("llama3-405b", {"ac": "full", "gpus_per_node": 4}),
])
def test_the_binary_search_finds_what_a_linear_scan_finds(model, changes):
    """The search assumes the peak never grows with the GPU count past 1; a scan of every count checks it."""
    from dataclasses import replace

    from posttrain.plan.fit import gpu_counts, peak_gib, smallest_fitting
    from posttrain.plan.report import PlanInputs
    from posttrain.plan.shapes import PRESETS

    shape, limit = PRESETS[model], 1024
    inputs = replace(PlanInputs(gpus=8, gpus_per_node=8), **changes)
    scanned = next((n for n in gpu_counts(inputs.gpus_per_node, limit)
                    if peak_gib(shape, replace(inputs, gpus=n)) <= inputs.gpu_memory_gib), None)
    assert scanned is not None  # each case fits somewhere below the limit, so the search has work to do
    assert smallest_fitting(shape, inputs, limit) == scanned
    assert gpu_counts(4, 20) == [1, 2, 3, 4, 8, 12, 16, 20]
