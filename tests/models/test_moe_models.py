"""Tiny mixture-of-experts models: built by `posttrain model tiny --arch …`, loaded by posttrain and plain
transformers, routed where posttrain's hooks look (posttrain.models.moe)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.cli import main
from posttrain.models.load import load_model, load_tokenizer
from posttrain.models.moe import active_share, routers
from posttrain.train.metrics import train_flops_per_token


@pytest.mark.parametrize(("arch", "shared"), [("qwen3_moe", None), ("deepseek_v3", "2")])
def test_tiny_moe_builds_loads_and_round_trips(arch, shared, tmp_path, capsys):
    path = tmp_path / arch
    args = ["model", "tiny", str(path), "--arch", arch, "--experts", "4", "--experts-per-token", "2", "--layers", "2",
            "--vocab-size", "300"]
    assert main(args + (["--shared-experts", shared] if shared else [])) == 0
    assert "tiny model written" in capsys.readouterr().out
    model = load_model(str(path))  # posttrain's loader (sdpa)
    tokenizer = load_tokenizer(str(path))
    assert model.config.model_type == arch and tokenizer.chat_template
    found = routers(model)
    # qwen3_moe: every layer sparse; deepseek_v3: the first layer dense, as DeepSeek-V3's first three are
    assert [layer for layer, _ in found] == ([0, 1] if arch == "qwen3_moe" else [1])
    assert all(router.top_k == 2 and router.weight.shape[0] == 4 for _, router in found)
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_up_proj.shape[0] == 4 and experts.down_proj.shape[0] == 4  # fused: one [E, …] tensor each
    if arch == "deepseek_v3":
        assert model.model.layers[1].mlp.shared_experts.gate_proj.out_features == 2 * model.config.moe_intermediate_size
        assert torch.equal(found[0][1].e_score_correction_bias, torch.zeros(4))  # a buffer: saved with the weights
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 plus 30?"}], return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size) and torch.isfinite(logits).all()
    model.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, logits, rtol=0, atol=0)
    # FLOPs per token count the experts a token uses (top-2 of 4: half of them), not all of them
    shares = active_share(model)
    assert set(shares.values()) == {0.5} and len(shares) == 2 * len(found)
    assert train_flops_per_token(model) < 6.0 * sum(p.numel() for p in model.parameters())


def test_moe_flags_are_refused_where_they_do_not_apply(tmp_path, capsys):
    assert main(["model", "tiny", str(tmp_path / "a"), "--experts", "4"]) == 2  # a dense model has no experts
    assert "--experts shape(s) a mixture of experts; add --arch" in capsys.readouterr().err
    assert main(["model", "tiny", str(tmp_path / "b"), "--arch", "qwen3_moe", "--shared-experts", "1"]) == 2
    assert "qwen3_moe has no shared experts" in capsys.readouterr().err
    assert main(["model", "tiny", str(tmp_path / "c"), "--arch", "qwen3_moe", "--experts", "2",
                 "--experts-per-token", "3"]) == 2
    assert not any((tmp_path / name).exists() for name in "abc")


def test_an_attention_shape_that_does_not_split_is_refused_in_posttrain_words(tmp_path, capsys):
    assert main(["model", "tiny", str(tmp_path / "a"), "--heads", "3"]) == 2
    assert "--hidden-size 64 does not split into 3 heads" in capsys.readouterr().err
    assert main(["model", "tiny", str(tmp_path / "b"), "--heads", "4", "--kv-heads", "3"]) == 2
    assert "--heads 4 is not a multiple of --kv-heads 3" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in "ab")
