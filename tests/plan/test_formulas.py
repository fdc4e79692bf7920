"""Each planner formula against values worked out by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import json
import math

import pytest

from posttrain.algorithms.registry import UnknownNameError
from posttrain.config.loader import ConfigError
from posttrain.plan import memory, timing
from posttrain.plan.shapes import PRESETS, ModelShape, load_shape

LLAMA_8B = PRESETS["llama3-8b"]


def test_llama3_presets_have_the_published_parameter_counts():
    # Published totals of meta-llama/Llama-3.1-{8B,70B,405B} (safetensors metadata / model cards).
    assert LLAMA_8B.total_params() == 8_030_261_248
    assert PRESETS["llama3-70b"].total_params() == 70_553_706_496
    assert PRESETS["llama3-405b"].total_params() == 405_853_388_800
    # 8B block by hand: Wq+Wo 2·4096² = 33,554,432; Wk+Wv 2·4096·1024 = 8,388,608; MLP 3·4096·14336 =
    # 176,160,768; norms 8,192 → 218,112,000.
    assert LLAMA_8B.block_params() == 218_112_000
    assert 0.95e12 < PRESETS["dense-1t"].total_params() < 1.05e12


def test_hf_config_json_is_read_and_bad_input_is_refused(tmp_path):
    config = {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 400, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = load_shape(str(tmp_path))
    # block: 2·64·64 + 2·64·32 + 3·64·176 + 128 = 8192 + 4096 + 33792 + 128 = 46,208; ×2 layers = 92,416;
    # tied embedding 400·64 = 25,600 once; final norm 64 → 118,080.
    assert shape.total_params() == 118_080
    assert shape.kv_fraction == 0.5
    del config["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="vocab_size"):
        load_shape(str(tmp_path))
    with pytest.raises(UnknownNameError, match="did you mean 'llama3-70b'"):
        load_shape("llama3-71b")


def test_model_states_bf16_fp32_and_offload():
    # 1e9 params, largest unit 1e8, 8 GPUs on one node.
    bf16 = memory.model_states(10**9, 10**8, 8, 8, "bf16", "none")
    assert bf16.sharded_gpu == 18e9 / 8  # 16 B fp32 state + 2 B bf16 shard copy
    assert bf16.gathered_gpu == 4e8  # bf16 params + grads of the unit
    fp32 = memory.model_states(10**9, 10**8, 8, 8, "fp32", "none")
    assert (fp32.sharded_gpu, fp32.gathered_gpu) == (16e9 / 8, 8e8)
    single = memory.model_states(10**9, 10**8, 1, 8, "fp32", "none")
    assert single.gathered_gpu == 0.0  # nothing is gathered on one device
    optimizer = memory.model_states(10**9, 10**8, 16, 8, "bf16", "optimizer")
    assert optimizer.sharded_gpu == 2e9 / 16
    assert optimizer.host_per_node == 16e9 / 16 * 8  # half of the state lives on each of the two nodes
    params = memory.model_states(10**9, 10**8, 16, 8, "bf16", "params")
    assert (params.sharded_gpu, params.host_per_node) == (0.0, 18e9 / 2)


def test_llama_activation_coefficient_for_gqa_and_swiglu():
    # bf16: 2·(6 + 2·(8·128/4096) + 4·14336/4096) = 2·(6 + 0.5 + 14) = 41 bytes per s·b·h.
    assert memory.layer_activation_coefficient(LLAMA_8B, "bf16") == 41.0
    assert memory.layer_activation_coefficient(LLAMA_8B, "fp32") == 82.0
    # A GPT-like shape without GQA and an MLP of 2h (so 4·i/h = 8): 2·(6 + 2 + 8) = 32, Korthikanti's 34 less
    # the two 1-byte dropout masks.
    gpt_like = ModelShape("gpt-like", 1024, 2048, 1, 16, 16, 1000)
    assert memory.layer_activation_coefficient(gpt_like) == 32.0


def test_activation_policies():
    seq, batch, h, layers = 8192, 2, 4096, 32
    selective = memory.ACTIVATION_POLICIES.get("selective")(LLAMA_8B, seq, batch, "bf16", True)
    assert selective == 32 * 41 * 8192 * 2 * 4096 == 88_046_829_568
    assert memory.ACTIVATION_POLICIES.get("none")(LLAMA_8B, seq, batch, "bf16", True) == selective
    # eager attention keeps 5·a·s²·b bytes per layer: 5·32·8192²·2 = 21,474,836,480 per layer.
    eager = memory.ACTIVATION_POLICIES.get("none")(LLAMA_8B, seq, batch, "bf16", False)
    assert eager - selective == 32 * 21_474_836_480
    full = memory.ACTIVATION_POLICIES.get("full")(LLAMA_8B, seq, batch, "bf16", True)
    assert full == layers * 2 * seq * batch * h + 41 * seq * batch * h  # 32 inputs + one block's working set
    with pytest.raises(UnknownNameError):
        memory.ACTIVATION_POLICIES.get("selctive")


def test_logits_and_kv_cache():
    # chunked: 2 (logits + grad) · 1024 · 128,256 · 4 B = 1,050,673,152; unchunked s·b = 16,384 tokens.
    assert memory.logits_bytes(LLAMA_8B, 8192, 2, 1024) == 1_050_673_152
    assert memory.logits_bytes(LLAMA_8B, 8192, 2, None) == 16 * 1_050_673_152
    # 2 · 32 layers · 8 kv heads · 128 · 1536 tokens · 8 seqs · 2 B = 1,610,612,736 B = 1.5 GiB.
    assert memory.kv_cache_bytes(LLAMA_8B, 1536, 8) == 1_610_612_736


def test_flops_and_fsdp_traffic():
    # 6·8,030,261,248·8192 = 394,703,397,261,312 ... plus 12·32·8192²·4096 = 105,553,116,266,496.
    assert timing.step_flops(LLAMA_8B, 8192, 1) == 6 * 8_030_261_248 * 8192 + 105_553_116_266_496
    traffic = timing.fsdp_bytes_per_gpu(10**9, 8)
    assert traffic == {"all_gather_forward": 1.75e9, "all_gather_backward": 1.75e9, "reduce_scatter": 3.5e9}
    assert timing.fsdp_bytes_per_gpu(10**9, 1)["reduce_scatter"] == 0.0
    assert timing.checkpoint_bytes(10**9) == 12e9


def test_young_daly_and_goodput():
    assert timing.young_daly_interval(60, 5 * 3600) == pytest.approx(math.sqrt(2_160_000))  # 1469.7 s
    assert math.isinf(timing.young_daly_interval(60, math.inf))
    rates = timing.Interruptions(unannounced_per_s=1e-4, announced_per_s=0.0, restart_s=100)
    # 1 − 10/1000 − 1e-4·(500 + 100) = 0.93
    assert timing.goodput(1000, 10, rates) == pytest.approx(0.93)
    with_notice = timing.Interruptions(1e-4, 2e-4, 100)
    assert timing.goodput(1000, 10, with_notice) == pytest.approx(0.93 - 2e-4 * 110)  # each loses C + R
    # 2 nodes, MTBF 1000 h each → 2/3.6e6 per s; 1 spot node at 0.36/h = 1e-4 per s.
    announced = timing.interruptions(2, 1, 1000, 0.36, notice_s=120, save_s=60, restart_s=300)
    assert announced.unannounced_per_s == pytest.approx(2 / 3.6e6)
    assert announced.announced_per_s == pytest.approx(1e-4)
    too_short = timing.interruptions(2, 1, 1000, 0.36, notice_s=30, save_s=60, restart_s=300)
    assert too_short.unannounced_per_s == pytest.approx(2 / 3.6e6 + 1e-4) and too_short.announced_per_s == 0
    # The Young/Daly interval beats its neighbours under this model.
    best = timing.best_interval(60, too_short)
    assert timing.goodput(best, 60, too_short) > timing.goodput(best / 2, 60, too_short)
    assert timing.goodput(best, 60, too_short) > timing.goodput(best * 2, 60, too_short)


def test_hf_layer_bookkeeping_and_per_op_recompute():
    tiny = ModelShape("measured", 512, 1376, 8, 8, 4, 384)  # the shape tests/plan/test_measured.py trains
    # fp32: norms 2·(4 + 4) = 16, plus 4·(5 + 2·0.5 + 4·2.6875) = 4·16.75 = 67 → 83; K, V expanded: 4·17.75 + 16 = 87.
    assert memory.layer_activation_coefficient(tiny, "fp32", "hf") == 83.0
    assert memory.layer_activation_coefficient(tiny, "fp32", "hf", expanded_kv=True) == 87.0
    # torchtitan's per-op AC, Llama-3 8B bf16: 2·(4 + 0.25 + 3.5) = 15.5 per s·b·h per layer, plus one block's 41.
    sbh = 8192 * 2 * 4096
    op = memory.ACTIVATION_POLICIES.get("op")(LLAMA_8B, 8192, 2, "bf16", True)
    assert op == 32 * 15.5 * sbh + 41 * sbh
