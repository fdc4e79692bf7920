"""The planner on mixture-of-experts models: parameter counts, EP × FSDP memory, all-to-all, HF configs, CLI.

Every expected number is worked out by hand in the comments (docs/plan.md, "Mixture of experts").
"""

from __future__ import annotations

import json

import pytest

from posttrain.cli import main
from posttrain.config.loader import ConfigError
from posttrain.plan import memory, timing
from posttrain.plan.fit import gpu_counts, peak_gib, smallest_fitting
from posttrain.plan.report import PlanInputs, build_plan
from posttrain.plan.shapes import PRESETS, ModelShape, load_shape

DSV3, KIMI = PRESETS["deepseek-v3"], PRESETS["kimi-k2"]
EXPERT = 3 * 7168 * 2048  # one SwiGLU expert of moe_intermediate 2,048: 44,040,192


def test_deepseek_v3_parameter_counts_by_hand():
    # MLA, 128 heads: W_qa 7168·1536 = 11,010,048 + norm 1,536 + W_qb 1536·128·(128+64) = 37,748,736 → 48,760,320;
    # W_kva 7168·(512+64) = 4,128,768 + norm 512 + W_kvb 512·128·(128+128) = 16,777,216 → 20,906,496;
    # Wo 128·128·7168 = 117,440,512. Attention 187,107,328.
    assert DSV3.attention_params() == 187_107_328
    # Dense block (3 layers): + 3·7168·18432 = 396,361,728 + two norms 14,336 = 583,483,392.
    assert DSV3.block_params() == 583_483_392
    # MoE block (58 layers): attention + router 256·7168 = 1,835,008 + 1 shared expert 44,040,192 + norms 14,336
    # = 232,996,864 outside the routed experts; 256 routed experts 11,274,289,152.
    assert DSV3.moe_block_dense_params() == 232_996_864
    assert DSV3.moe_block_expert_params() == 256 * EXPERT == 11_274_289_152
    # 3·583,483,392 + 58·11,507,286,016 + embedding and head 2·129,280·7,168 + final norm 7,168.
    assert DSV3.total_params() == 1_750_450_176 + 667_422_588_928 + 1_853_358_080 + 7_168 == 671_026_404_352
    # Active: 248 of 256 routed experts idle in 58 layers (633,474,121,728) and no input embedding (926,679,040).
    assert DSV3.active_params() == 671_026_404_352 - 58 * 248 * EXPERT - 129_280 * 7_168 == 36_625_603_584
    assert DSV3.flop_params() == 36_625_603_584 + 926_679_040
    # Published: 671B total, 37B activated (DeepSeek-V3 technical report, arXiv 2412.19437).
    assert DSV3.total_params() == pytest.approx(671e9, rel=0.02)
    assert DSV3.active_params() == pytest.approx(37e9, rel=0.02)


def test_kimi_k2_parameter_counts_by_hand():
    # MLA, 64 heads: 11,010,048 + 1,536 + 1536·64·192 = 18,874,368 → 29,885,952; 4,128,768 + 512 + 512·64·256 =
    # 8,388,608 → 12,517,888; Wo 64·128·7168 = 58,720,256. Attention 101,124,096.
    assert KIMI.attention_params() == 101_124_096
    assert KIMI.block_params() == 101_124_096 + 396_361_728 + 14_336  # the one dense layer: 497,500,160
    # MoE block: 101,124,096 + router 384·7168 = 2,752,512 + shared 44,040,192 + 14,336 = 147,931,136, plus
    # 384 experts 16,911,433,728 = 17,059,364,864; 60 of them.
    assert KIMI.moe_block_params() == 147_931_136 + 384 * EXPERT == 17_059_364_864
    total = 497_500_160 + 60 * 17_059_364_864 + 2 * 163_840 * 7_168 + 7_168
    assert KIMI.total_params() == total == 1_026_408_209_408
    assert KIMI.active_params() == total - 60 * 376 * EXPERT - 163_840 * 7_168 == 31_687_072_768
    # Published: about 1.04T total (1T on the model card), 32B activated (Kimi K2 report / model card).
    assert KIMI.total_params() == pytest.approx(1.04e12, rel=0.02)
    assert KIMI.active_params() == pytest.approx(32e9, rel=0.02)
    assert KIMI.total_params() > PRESETS["dense-1t"].total_params()  # the trillion case
    assert not PRESETS["llama3-8b"].is_moe and PRESETS["llama3-8b"].flop_params() == 8_030_261_248


def test_expert_parallel_divides_the_gathered_experts_not_the_sharded_states():
    def plan(gpus: int, ep: int) -> dict:
        return build_plan(DSV3, PlanInputs(gpus=gpus, gpus_per_node=8, expert_parallel=ep, ac="full"))["memory_bytes"]

    no_ep, ep8 = plan(64, 1), plan(64, 8)
    # Without EP a GPU gathers a whole MoE layer: 4 B · (232,996,864 + 11,274,289,152) = 46,029,144,064 B (42.9 GiB).
    assert no_ep["gathered_unit"] == 4 * (232_996_864 + 11_274_289_152)
    assert no_ep["gathered_experts"] == 4 * 11_274_289_152
    # EP 8: its 32 of 256 experts, 4 · 1,409,286,144; the dense parts are still gathered whole.
    assert ep8["gathered_experts"] == 4 * 11_274_289_152 / 8
    assert ep8["gathered_unit"] == 4 * (232_996_864 + 11_274_289_152 // 8)
    # The persistent state is 18 B / param over all 64 GPUs either way (EP × FSDP(N/EP) shards experts N ways).
    assert ep8["sharded_states"] == no_ep["sharded_states"] == 18 * 671_026_404_352 / 64
    assert ep8["expert_states"] == 18 * 58 * 11_274_289_152 / 64
    # EP = N: each rank's experts are whole and not gathered; the largest unit is the 129,280 × 7,168 head.
    assert plan(64, 64)["gathered_unit"] == 4 * 129_280 * 7_168 and plan(64, 64)["gathered_experts"] == 0
    assert no_ep["peak_per_gpu"] - ep8["peak_per_gpu"] == pytest.approx(4 * 11_274_289_152 * 7 / 8)


def test_all_to_all_bytes_and_time_by_hand():
    # DeepSeek-V3, one 4,096-token sequence per GPU, EP 8, bf16: per direction and pass
    # 58 layers · 4,096 tokens · 8 copies · 7,168 · 2 B · 7/8 leave the rank = 23,840,423,936 B.
    one = 23_840_423_936
    assert 58 * 4096 * 8 * 7168 * 2 * 7 // 8 == one
    a2a = timing.all_to_all_bytes_per_gpu(DSV3, 4096, 8)
    assert a2a == {"dispatch_forward": one, "combine_forward": one, "backward": 2 * one, "recompute": 0.0}
    assert timing.all_to_all_bytes_per_gpu(DSV3, 4096, 8, recompute=True)["recompute"] == 2 * one
    assert sum(timing.all_to_all_bytes_per_gpu(DSV3, 4096, 1).values()) == 0  # experts local: nothing moves
    comm = build_plan(DSV3, PlanInputs(gpus=64, gpus_per_node=8, expert_parallel=8, seq=4096))[
        "communication_per_microbatch"]
    assert comm["all_to_all_bytes"] == 4 * one
    assert comm["all_to_all_seconds"] == pytest.approx(4 * one / 50e9)  # 400 Gb/s = 50e9 B/s: 1.907 s
    # FLOPs use the parameters a token computes with: 6 · 37,552,282,624 · 4096 + 6·61·4096²·(24,576 + 16,384).
    flops = 6 * 37_552_282_624 * 4096 + 6 * 61 * 4096**2 * (128 * 192 + 128 * 128)
    assert timing.step_flops(DSV3, 4096, 1) == flops


def test_fsdp_traffic_splits_dense_parts_and_experts():
    experts = 58 * 11_274_289_152
    dense = 671_026_404_352 - experts
    traffic = timing.moe_fsdp_bytes_per_gpu(DSV3, 64, 8)
    # dense over 64 GPUs (63/64), each rank's experts / 8 over the 8 GPUs sharing them (7/8).
    assert traffic["all_gather_forward"] == pytest.approx(2 * dense * 63 / 64 + 2 * experts / 8 * 7 / 8)
    assert traffic["reduce_scatter"] == pytest.approx(4 * dense * 63 / 64 + 4 * experts / 8 * 7 / 8)
    assert timing.moe_fsdp_bytes_per_gpu(PRESETS["llama3-8b"], 8) == timing.fsdp_bytes_per_gpu(8_030_261_248, 8)


def test_mla_kv_cache_is_the_latent():
    # 61 layers · (512 + 64) · 1,536 tokens · 8 sequences · 2 B = 863,502,336 B.
    assert memory.kv_cache_bytes(DSV3, 1536, 8) == 61 * 576 * 1536 * 8 * 2 == 863_502_336


QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B config.json (the fields the planner reads)
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
    "tie_word_embeddings": False, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3 config.json
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "vocab_size": 129280, "tie_word_embeddings": False,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "num_nextn_predict_layers": 1}


def _write(tmp_path, config: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_qwen3_moe_config_json(tmp_path):
    shape = load_shape(_write(tmp_path, QWEN3_30B_A3B))
    assert (shape.num_experts, shape.experts_per_token, shape.moe_layers, shape.shared_experts) == (128, 8, 48, 0)
    assert shape.qk_norm and not shape.is_mla
    # Block: attention 2·2048·4096 + 2·2048·512 + q/k norms 256 = 18,874,624; router 128·2048 = 262,144;
    # experts 128·3·2048·768 = 603,979,776; norms 4,096 → 623,120,640. ×48 + 2·151,936·2,048 + 2,048.
    assert shape.total_params() == 48 * 623_120_640 + 622_329_856 + 2048 == 30_532_122_624  # "30.5B"
    # Qwen's "3.3B activated" counts the input embedding too: our flop_params; active (no lookup table) is 3.04B.
    assert shape.flop_params() == 30_532_122_624 - 48 * 120 * 3 * 2048 * 768 == 3_353_032_704
    assert shape.active_params() == 3_353_032_704 - 151_936 * 2048
    # mlp_only_layers and decoder_sparse_step pick the MoE layers as Qwen3MoeDecoderLayer does.
    sparse = load_shape(_write(tmp_path, {**QWEN3_30B_A3B, "mlp_only_layers": [0, 1], "decoder_sparse_step": 2}))
    assert sparse.moe_layers == 23  # odd indices 1, 3, …, 47 are sparse (24) less layer 1
    assert sparse.total_params() == shape.total_params() - 25 * (603_979_776 + 262_144 - 3 * 2048 * 6144)


def test_deepseek_v3_config_json_matches_the_preset(tmp_path):
    shape = load_shape(_write(tmp_path, DEEPSEEK_V3))
    assert shape.is_mla and shape.moe_layers == 58 and shape.shared_experts == 1
    assert shape.total_params() == DSV3.total_params() and shape.active_params() == DSV3.active_params()
    broken = {key: value for key, value in DEEPSEEK_V3.items() if key != "moe_intermediate_size"}
    with pytest.raises(ConfigError, match="moe_intermediate_size"):
        load_shape(_write(tmp_path, broken))


def test_hf_moe_activation_coefficient_by_hand():
    # A Qwen3-MoE-like shape in fp32 (e = 4): h 256, 4 heads of 64 (2 KV heads), q/k norms, 16 experts, top-2,
    # moe_intermediate 512. Attention part, HF layers: norms 2·(4+4) = 16; e·(1 + q 1 + k 0.5 + v 0.5 + 2·o 2 +
    # MLP input 1) = 4·6 = 24; q/k norms (4+4)·(1 + 0.5) = 12 → 52. MoE MLP: 4·2·(2 + 4·2) = 80 + router 4·16/256
    # = 0.25 → 132.25 bytes per s·b·h; a dense MLP of 1,024 instead: 4·4·4 = 64 → 116.
    shape = ModelShape("tiny-moe", 256, 1024, 6, 4, 2, 384, head_dim=64, qk_norm=True, num_experts=16,
                       experts_per_token=2, moe_intermediate_size=512, moe_layers=5)
    assert memory.layer_activation_coefficient(shape, "fp32", "hf", moe=True) == 132.25
    assert memory.layer_activation_coefficient(shape, "fp32", "hf") == 116.0
    sbh = 64 * 8 * 256
    assert memory.ACTIVATION_POLICIES.get("none")(shape, 64, 8, "fp32", True, "hf") == (116 + 5 * 132.25) * sbh


def test_cli_plans_kimi_k2_with_expert_parallel(capsys, tmp_path):
    out = tmp_path / "plan.json"
    flags = ["--model", "kimi-k2", "--gpus", "256", "--expert-parallel", "64", "--ac", "full", "--gpu", "h200"]
    assert main(["plan", *flags, "--json", str(out)]) == 0
    stdout = capsys.readouterr().out
    plan = json.loads(out.read_text())
    assert "1,026.41B params, 31.69B active; 384 experts, 8 per token, EP 64" in stdout
    assert "all-to-all (EP 64, 60 MoE layers" in stdout and plan["inputs"]["expert_parallel"] == 64
    assert plan["model"]["active_params"] == 31_687_072_768 and plan["verdict"]["fits"]
    for bad, message in ((["--expert-parallel", "48"], "does not divide --gpus 256"),
                         (["--expert-parallel", "512", "--gpus", "512"], "384 routed experts")):
        assert main(["plan", *flags, *bad]) == 2
        assert message in capsys.readouterr().err
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--expert-parallel", "2"]) == 2
    assert "is dense" in capsys.readouterr().err


def test_fit_search_with_expert_parallel_matches_a_scan():
    """Counts are multiples of EP; at N = EP nothing of the experts is gathered, so it is tried on its own."""
    assert gpu_counts(8, 64, expert_parallel=16) == [16, 32, 48, 64]
    for shape, ep in ((DSV3, 8), (DSV3, 64), (KIMI, 32)):
        inputs = PlanInputs(gpus=ep, gpus_per_node=8, expert_parallel=ep, ac="full")
        scanned = next((n for n in gpu_counts(8, 4096, ep) if peak_gib(shape, PlanInputs(
            gpus=n, gpus_per_node=8, expert_parallel=ep, ac="full")) <= inputs.gpu_memory_gib), None)
        assert scanned is not None
        assert smallest_fitting(shape, inputs, 4096) == scanned
