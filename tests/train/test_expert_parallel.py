"""Expert parallelism (``parallel.expert``): the same numbers as without it, and checkpoints that reshard.

Two ranks with gloo, on tiny MoE models. Few launches (each torchrun costs seconds on a 2-core CI): one worker
compares every gradient three ways (no EP, EP=1, EP=2; Qwen3-MoE and DeepSeek-V3); one chain of SFT runs
checks a SIGKILLed EP=2 run resumes bit for bit, and its checkpoint resumes at EP=1.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from posttrain.config import ConfigError, load_config
from posttrain.config.recipes import SFTRecipe
from posttrain.train.expert_parallel import check_expert_degree
from posttrain.train.identity import config_identity
from tests.train.conftest import ROOT, base_overrides, env, final_weights, read_jsonl, run_subprocess


def tiny_qwen3_moe(tokenizer_dir: str, path, experts: int = 4):
    """A 2-layer Qwen3-MoE (``experts`` experts, top-2) with the tiny Llama's tokenizer, saved at ``path``."""
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=experts, num_experts_per_tok=2, norm_topk_prob=True,
                            max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # routing far from uniform, so a wrong dispatch changes the numbers
        for name, param in model.named_parameters():
            if param.dim() == 3:
                param.normal_(0, 0.1)
            elif name.endswith("gate.weight"):
                param.normal_(0, 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def moe_dir(tiny_model_dir, tmp_path_factory) -> str:
    return tiny_qwen3_moe(tiny_model_dir, tmp_path_factory.mktemp("moe") / "model")


def test_parallel_section_is_typed_and_not_part_of_the_run_identity():
    base = ["output_dir=runs/x", "model.path=m", "data.train=train.jsonl"]
    assert load_config(SFTRecipe, None, base).parallel.expert == 1
    assert load_config(SFTRecipe, None, [*base, "parallel.expert=2"]).parallel.expert == 2
    with pytest.raises(ConfigError, match="parallel.expert"):
        load_config(SFTRecipe, None, [*base, "parallel.expert=0"])
    with pytest.raises(ConfigError, match="parallel.experts"):  # unknown keys are errors, never dropped
        load_config(SFTRecipe, None, [*base, "parallel.experts=2"])
    one, two = (load_config(SFTRecipe, None, [*base, f"parallel.expert={n}"]).model_dump() for n in (1, 2))
    assert config_identity(one) == config_identity(two)  # a checkpoint resumes at another EP degree


def test_grpo_takes_expert_parallelism_with_the_vllm_engine_only():
    from posttrain.config.rl import GRPORecipe

    base = ["output_dir=runs/x", "model.path=m", "data.train=p.jsonl", "parallel.expert=2"]
    with pytest.raises(ConfigError, match="in-process sampler decodes each rank's prompts separately.*"
                                          "set rollout.engine=vllm"):
        load_config(GRPORecipe, None, base)  # rollout.engine=hf, the default
    assert load_config(GRPORecipe, None, [*base, "rollout.engine=vllm"]).parallel.expert == 2
    with pytest.raises(ConfigError, match="held-out evaluation decodes greedily.*remove data.eval"):
        load_config(GRPORecipe, None, [*base, "rollout.engine=vllm", "data.eval=e.jsonl"])


def test_the_expert_degree_is_checked_against_the_model_and_the_ranks(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert check_expert_degree(dense, 1, 2) == []
    with pytest.raises(ValueError, match="no mixture-of-experts layers.*set parallel.expert=1 for a dense model"):
        check_expert_degree(dense, 2, 2)
    moe = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe(tiny_model_dir, tmp_path / "moe6", experts=6))
    assert len(check_expert_degree(moe, 2, 4)) == 2
    with pytest.raises(ValueError, match="does not divide the 2 rank"):
        check_expert_degree(moe, 4, 2)
    with pytest.raises(ValueError, match="does not divide the 6 experts"):
        check_expert_degree(moe, 4, 4)


@pytest.mark.slow
def test_every_gradient_matches_without_expert_parallelism(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "tests.train.moe_ep_worker", str(tmp_path)]
    proc = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for arch, layers in (("qwen3_moe", 2), ("deepseek_v3", 1)):  # DeepSeek-V3's first layer is dense
            assert record[arch]["ep1"]["ep_layers"] == 0 and record[arch]["ep2"]["ep_layers"] == layers
            assert record[arch]["ep2"]["all_to_all_calls"] > 0
            for expert in ("ep1", "ep2"):
                assert record[arch][expert]["loss_diff"] <= 1e-5, (arch, expert)
                assert record[arch][expert]["grad_diff"] <= 1e-5, (arch, expert)
            assert record[arch]["ep2"]["grad_scale"] > 1e-2  # the gradients compared are not all ~0


RUN = {"train.max_steps": 5, "train.save_every": 3, "train.keep_last": 4, "train.batch_size": 2,
       "train.global_batch_size": 8, "data.shuffle": "false"}


def steps(out) -> dict[int, tuple[float, float]]:
    return {m["step"]: (m["loss"], m["grad_norm"]) for m in read_jsonl(out / "metrics.jsonl") if "loss" in m}


@pytest.mark.slow
def test_sigkill_resume_at_ep2_is_bit_exact_and_its_checkpoint_resumes_at_ep1(moe_dir, sft_data, tmp_path):
    """One uninterrupted-then-killed EP=2 run is the reference: it trains steps 0-4 (checkpoint at 3) and is
    SIGKILLed after step 4's update, before its export. Resumed at EP=2 it must repeat steps 3 and 4 bit for
    bit (their loss and grad norm depend on every earlier update); resumed at EP=1 (2 ranks, the experts
    sharded by FSDP alone) from the same checkpoint, to float rounding."""
    killed, moved = tmp_path / "killed", tmp_path / "moved"
    ep2 = {**RUN, "parallel.expert": 2}
    crashed = run_subprocess(base_overrides(moe_dir, sft_data, killed, **ep2, **{"debug.crash_at_step": 4}), nproc=2)
    assert crashed.returncode != 0 and not (killed / "final").exists(), crashed.stderr[-3000:]
    assert "'expert_parallel': 2, 'ep_layers': 2" in crashed.stderr
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == ["step-000003"]
    reference = steps(killed)
    assert sorted(reference) == [0, 1, 2, 3, 4]
    shutil.copytree(killed, moved)

    resumed = run_subprocess(base_overrides(moe_dir, sft_data, killed, **ep2), nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [a["step"] for a in read_jsonl(killed / "alerts.jsonl") if a["kind"] == "resumed"] == [3]
    assert steps(killed) == reference  # bit for bit: the same floats in the same records

    at_ep1 = run_subprocess(base_overrides(moe_dir, sft_data, moved, **RUN, **{"parallel.expert": 1}), nproc=2)
    assert at_ep1.returncode == 0, at_ep1.stderr[-3000:]
    assert "'expert_parallel': 1, 'ep_layers': 0" in at_ep1.stderr
    assert [a["step"] for a in read_jsonl(moved / "alerts.jsonl") if a["kind"] == "resumed"] == [3]
    for step, (loss, grad_norm) in steps(moved).items():
        assert loss == pytest.approx(reference[step][0], rel=1e-5), step
        assert grad_norm == pytest.approx(reference[step][1], rel=1e-5), step
    a, b = final_weights(moved), final_weights(killed)
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the grouped GEMM path runs on CUDA only (bf16, SM80+)")
def test_grouped_gemm_matches_one_matmul_pair_per_expert():
    from posttrain.train.expert_parallel import grouped_mm_available, local_experts

    torch.manual_seed(0)
    x = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(4, 32, 32, device="cuda", dtype=torch.bfloat16) * 0.1
    down = torch.randn(4, 32, 16, device="cuda", dtype=torch.bfloat16) * 0.1
    counts = [30, 0, 24, 10]  # an expert with no rows too
    if not grouped_mm_available(x):
        pytest.skip("torch._grouped_mm needs SM80+")
    grouped = local_experts(x, counts, gate_up, down, torch.nn.functional.silu, grouped=True)
    loop = local_experts(x, counts, gate_up, down, torch.nn.functional.silu, grouped=False)
    torch.testing.assert_close(grouped.float(), loop.float(), rtol=2e-2, atol=2e-2)
