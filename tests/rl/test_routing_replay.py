"""Rollout routing replay (rl.routing_replay, posttrain.models.routing_replay): the gates at given experts against
hand computation, the recorder and the replay round trip, the first-update log-ratio with and without replay under
bf16 sampling / fp32 training (the real-world mismatch), JSON exactness, config refusals and a GRPO run."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from posttrain.cli import main
from posttrain.generate.engine import SamplingParams
from posttrain.models.logprobs import loss_positions, model_token_logprobs
from posttrain.models.moe import routers
from posttrain.models.routing_replay import (
    UNROUTED,
    RoutingReplay,
    deepseek_v3_gate,
    qwen3_moe_gate,
    routing_layout,
)
from posttrain.rl.offpolicy import decode_rollout, encode_rollout
from posttrain.rl.rollout import Rollout, completion_logprobs, rollout_batch, sample_rollouts
from tests.rl.conftest import grpo_overrides, rl_data  # noqa: F401 - rl_data is a fixture used below
from tests.train.conftest import read_jsonl

PROMPTS = [[{"role": "user", "content": text}] for text in
           ("What is 2+2?", "Name a colour.", "Tell me a story about a cat.", "hi")]


# ----------------------------------------------------------------------------- gates


def test_qwen3_moe_gate_is_softmax_at_the_given_experts():
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0]])
    experts = torch.tensor([[3, 1]])  # not the top-2: replay may force any experts
    z = sum(math.exp(v) for v in (1.0, 2.0, 0.5, -1.0))
    p3, p1 = math.exp(-1.0) / z, math.exp(2.0) / z
    assert qwen3_moe_gate(logits, experts, normalize=False).tolist()[0] == pytest.approx([p3, p1], rel=1e-6)
    assert qwen3_moe_gate(logits, experts, normalize=True).tolist()[0] == pytest.approx([p3 / (p3 + p1),
                                                                                         p1 / (p3 + p1)], rel=1e-6)


def test_deepseek_v3_gate_is_scaled_normalised_sigmoid_at_the_given_experts():
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0]])
    experts = torch.tensor([[3, 1]])
    s3, s1 = 1 / (1 + math.exp(1.0)), 1 / (1 + math.exp(-2.0))
    assert deepseek_v3_gate(logits, experts, normalize=False, scale=2.5).tolist()[0] == pytest.approx(
        [2.5 * s3, 2.5 * s1], rel=1e-6)
    assert deepseek_v3_gate(logits, experts, normalize=True, scale=2.5).tolist()[0] == pytest.approx(
        [2.5 * s3 / (s3 + s1), 2.5 * s1 / (s3 + s1)], rel=1e-6)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_the_gate_at_the_routers_own_choice_is_the_routers_weights(arch, tiny_moe_dir):
    """At the experts the router chose itself, the replayed weights are exactly the router's (a bias included)."""
    from posttrain.models.load import load_model
    from posttrain.models.routing_replay import GATES

    lm = load_model(tiny_moe_dir(arch), "float32")
    _, router = routers(lm)[0]
    if arch == "deepseek_v3":
        router.e_score_correction_bias.copy_(torch.randn(router.e_score_correction_bias.shape) * 0.1)
    hidden = torch.randn(5, router.weight.shape[1])
    logits, weights, chosen = router(hidden)
    assert torch.equal(GATES[arch](router, logits, chosen), weights)


# ----------------------------------------------------------------------------- record and replay


def _policy(path: str):
    from posttrain.models.load import load_model, load_tokenizer

    return load_model(path, "float32"), load_tokenizer(path)


def _sample(lm, tok, *, bf16: bool = False, n: int = 4) -> list[Rollout]:
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=24, logprobs=True, routed_experts=True, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        groups = sample_rollouts(lm, lm, tok, PROMPTS, params, batch_size=16)
    return [rollout for group in groups for rollout in group]


def _log_ratios(lm, rollouts: list[Rollout], pad_id: int, replay: RoutingReplay | None):
    """The first update's log-ratio (the fp32 training forward − the sampler's log-prob) per completion token,
    and the routing agreement when replayed."""

    def forward(input_ids, labels, *, temperature, return_entropy, positions):
        return model_token_logprobs(lm, input_ids, labels, temperature=temperature, return_entropy=return_entropy,
                                    positions=positions)

    batch = rollout_batch(rollouts, pad_id, 1.0)
    batch.update(loss_positions(batch["labels"]))
    keep = batch["completion_mask"]
    with torch.no_grad():
        if replay is None:
            return (completion_logprobs(forward, batch, 1.0) - batch["old_logprobs"])[keep], None
        with replay.forced(batch["routed_experts"]):
            values = completion_logprobs(forward, batch, 1.0)
            agreement = replay.agreement(keep.shape)[keep].mean().item()
    return (values - batch["old_logprobs"])[keep], agreement


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_recorded_routing_replays_the_samplers_forward(arch, tiny_moe_dir):
    """fp32 sampling (left padding, a KV cache, rows finishing at different steps) → every recorded choice is the
    one the full training forward makes (agreement 1) and replaying it changes no log-prob."""
    lm, tok = _policy(tiny_moe_dir(arch))
    rollouts = _sample(lm, tok)
    layers = len(routers(lm))
    assert len({len(r.prompt_ids) for r in rollouts}) > 1  # left padding at sampling time
    for r in rollouts:
        routed = r.routed_experts
        assert routed.dtype == np.int16 and routed.shape == (len(r.prompt_ids) + len(r.completion_ids), layers, 2)
        assert (routed[-1] == UNROUTED).all() and (routed[:-1] >= 0).all() and (routed[:-1] < 4).all()
    replay = RoutingReplay(lm, arch)
    free, _ = _log_ratios(lm, rollouts, tok.pad_token_id, None)
    replayed, agreement = _log_ratios(lm, rollouts, tok.pad_token_id, replay)
    assert agreement == 1.0
    assert torch.equal(free, replayed)  # the same experts, the same weights, bit for bit
    assert replayed.abs().max() < 1e-5


# bf16 sampling vs fp32 training on a random tiny MoE with 16 experts (top-2), 16 completions of up to 24 tokens.
# Measured here (CPU, torch 2.13), mean / max |log π_train − log π_sampler| over the completion tokens:
#   deepseek_v3: agreement 0.922; without replay 1.39e-3 / 3.05e-2, with replay 4.10e-4 / 1.95e-3
#   qwen3_moe:   agreement 0.995; without replay 5.80e-4 / 8.73e-3, with replay 5.40e-4 / 2.51e-3
# (fp32 sampling: 7.6e-8 / 4.8e-7 either way.) What replay leaves is bf16's dense rounding noise.
R3_BOUNDS = {"deepseek_v3": (0.97, 4.0, 2.0), "qwen3_moe": (0.999, 2.0, 1.0)}  # agreement <, max ratio >, mean >


@pytest.fixture(scope="module")
def moe16(tmp_path_factory):
    from posttrain.models.tiny import build_tiny_model
    from tests.conftest import CHAT_TEXTS

    def build(arch: str) -> str:
        path = tmp_path_factory.mktemp(f"moe16-{arch}") / "model"
        return str(build_tiny_model(path, texts=CHAT_TEXTS, vocab_size=400, seed=0, arch=arch, experts=16,
                                    experts_per_token=2, shared_experts=int(arch == "deepseek_v3")))

    return build


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_replay_removes_the_routing_part_of_the_bf16_sampling_mismatch(arch, moe16, capsys):
    lm, tok = _policy(moe16(arch))
    rollouts = _sample(lm, tok, bf16=True)
    free, _ = _log_ratios(lm, rollouts, tok.pad_token_id, None)
    replayed, agreement = _log_ratios(lm, rollouts, tok.pad_token_id, RoutingReplay(lm, arch))
    figures = {"agreement": agreement, "free_mean": free.abs().mean().item(), "free_max": free.abs().max().item(),
               "replay_mean": replayed.abs().mean().item(), "replay_max": replayed.abs().max().item()}
    with capsys.disabled():
        print(f"\nR3 {arch} bf16 sampling / fp32 training: {json.dumps(figures)}")
    agreement_below, max_ratio, mean_ratio = R3_BOUNDS[arch]
    assert agreement < agreement_below  # the bf16 sampler routed some tokens elsewhere
    assert figures["free_max"] > max_ratio * figures["replay_max"]
    assert figures["free_mean"] > mean_ratio * figures["replay_mean"]
    assert figures["replay_max"] < 5e-3  # bf16 noise only


def test_replay_makes_a_selection_only_perturbation_vanish(tiny_moe_dir):
    """DeepSeek-V3's correction bias only chooses experts: a sampler with other biases (e.g. before an
    aux-loss-free update) routes elsewhere; replayed, the training forward is the sampler's to float rounding.
    Measured: agreement 0.311; mean / max |log-ratio| 1.04e-2 / 7.12e-2 without replay, 7.5e-8 / 9.5e-7 with it."""
    lm, tok = _policy(tiny_moe_dir("deepseek_v3"))
    biases = [router.e_score_correction_bias for _, router in routers(lm)]
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for bias in biases:
            bias.copy_(torch.randn(bias.shape, generator=generator) * 0.05)
    rollouts = _sample(lm, tok)
    with torch.no_grad():
        for bias in biases:
            bias.zero_()
    free, _ = _log_ratios(lm, rollouts, tok.pad_token_id, None)
    replayed, agreement = _log_ratios(lm, rollouts, tok.pad_token_id, RoutingReplay(lm, "deepseek_v3"))
    assert agreement < 0.9 and free.abs().max() > 1e-3
    assert replayed.abs().max() < 1e-5


def test_replay_holds_through_an_activation_checkpointing_recompute(tiny_moe_dir):
    """The loss function loads the routing and returns; the backward recomputes each checkpointed layer after
    that. Forced experts unlike the router's own must give the same gradients with and without recompute."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    lm, _ = _policy(tiny_moe_dir("qwen3_moe"))
    replay = RoutingReplay(lm, "qwen3_moe")
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, 300, (2, 6), generator=generator)
    forced = torch.rand(2, 6, 2, 4, generator=generator).argsort(dim=-1)[..., :2].to(torch.int16)

    def gradients() -> list[torch.Tensor]:
        lm.zero_grad(set_to_none=True)
        replay.load(forced)
        loss = lm(input_ids=input_ids).logits.float().logsumexp(-1).sum()
        assert replay.agreement((2, 6)).mean() < 0.9  # the forced experts are mostly not the router's
        loss.backward()
        return [p.grad.clone() for p in lm.parameters() if p.grad is not None]

    plain = gradients()
    layers = lm.model.layers
    for index in range(len(layers)):
        layers[index] = checkpoint_wrapper(layers[index])
    recomputed = gradients()
    replay.unload()
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, recomputed, strict=True))


def test_replay_refuses_a_batch_without_or_with_misfit_routing(tiny_moe_dir):
    lm, _ = _policy(tiny_moe_dir("qwen3_moe"))
    replay = RoutingReplay(lm, "qwen3_moe")
    with pytest.raises(ValueError, match="carries no recorded routing"):
        replay.load(None)
    replay.load(torch.zeros(1, 3, 2, 2, dtype=torch.int16))
    with torch.enable_grad(), pytest.raises(ValueError, match="does not fit a router forward of 8 tokens"):
        lm(input_ids=torch.ones(2, 4, dtype=torch.long))
    replay.unload()
    lm(input_ids=torch.ones(2, 4, dtype=torch.long))  # unloaded: routes freely


def test_routing_layout_pads_with_unrouted():
    a = np.arange(6, dtype=np.int16).reshape(3, 1, 2)
    out = routing_layout([a, a[:1]], 4)
    assert out.dtype == torch.int16 and out.shape == (2, 4, 1, 2)
    assert out[0, :3].flatten().tolist() == list(range(6)) and (out[0, 3] == UNROUTED).all()
    assert (out[1, 1:] == UNROUTED).all()


# ----------------------------------------------------------------------------- JSON


def _rollout(**changes) -> Rollout:
    values = {"prompt_key": 1, "sample_index": 0, "prompt_ids": [5, 6], "completion_ids": [7, 8, 9],
              "logprobs": [-0.5, -1.0, -2.0], "finish_reason": "eos", "truncated": False, "text": "x",
              "temperature": 1.0,
              "routed_experts": np.array([[[0, 383]], [[2, 1]], [[3, 0]], [[1, 2]], [[-1, -1]]], dtype=np.int16)}
    values.update(changes)
    return Rollout(**values)


def test_routed_experts_go_through_json_exactly():
    rollout = _rollout()
    back = decode_rollout(json.loads(json.dumps(encode_rollout(rollout))))
    assert back == rollout and back.routed_experts.dtype == np.int16
    assert np.array_equal(back.routed_experts, rollout.routed_experts)
    assert decode_rollout(encode_rollout(_rollout(routed_experts=None))).routed_experts is None


@pytest.mark.parametrize(("change", "message"), [
    ({"shape": [4, 1, 2]}, "4 rows for 5 tokens"),
    ({"shape": [5, 1, 3]}, "holds 10 ids"),
    ({"shape": [5, 1]}, "not \\[tokens, layers, K\\]"),
    ({"ids": "not base64!"}, "not base64"),
    ({"ids": None}, "not a base64 string"),
    ({"ids": encode_rollout(_rollout(routed_experts=np.full((5, 1, 2), -2, dtype=np.int16)))["routed_experts"]["ids"]},
     "below -1"),
    ({"extra": 1}, "shape and ids"),
])
def test_malformed_routed_experts_are_refused(change, message):
    data = encode_rollout(_rollout())
    data["routed_experts"] = {**data["routed_experts"], **change}
    with pytest.raises(ValueError, match=message):
        decode_rollout(data)


def test_a_batch_replays_all_its_rollouts_or_none():
    with pytest.raises(ValueError, match="all its rollouts or of none"):
        rollout_batch([_rollout(), _rollout(routed_experts=None)], 0, 1.0)
    batch = rollout_batch([_rollout(), _rollout(completion_ids=[7], logprobs=[-0.5],
                                                routed_experts=np.zeros((3, 1, 2), dtype=np.int16))], 0, 1.0)
    assert batch["routed_experts"].shape == (2, 5, 1, 2) and (batch["routed_experts"][1, 3:] == UNROUTED).all()


# ----------------------------------------------------------------------------- config and the CLI


def test_routing_replay_with_the_vllm_engine_is_a_config_error(tiny_moe_dir, rl_data, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "vllm"
    args = grpo_overrides(tiny_moe_dir("qwen3_moe"), rl_data, out, **{"rl.routing_replay": "true",
                                                                         "rollout.engine": "vllm"})
    assert main(["grpo", "--config", "grpo_tiny", *args]) == 2
    assert "only rollout.engine=hf does" in capsys.readouterr().err and not out.exists()


def test_routing_replay_on_a_dense_model_is_a_config_error(tiny_model_dir, rl_data, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "dense"
    args = grpo_overrides(tiny_model_dir, rl_data, out, **{"rl.routing_replay": "true"})
    assert main(["grpo", "--config", "grpo_tiny", *args]) == 2
    err = capsys.readouterr().err
    assert "rl.routing_replay is set but" in err and "dense llama model" in err
    assert not out.exists()  # refused before any run state was written


def test_grpo_with_routing_replay_on_a_tiny_moe(tiny_moe_dir, rl_data, tmp_path):  # noqa: F811
    """Two steps through the CLI, bf16 training forward (the sampler runs in fp32: a real mismatch), one step of
    staleness so the checkpoint queues rollouts with their routing; the step logs the routing agreement."""
    out = tmp_path / "r3"
    args = grpo_overrides(tiny_moe_dir("deepseek_v3"), rl_data, out, **{
        "rl.routing_replay": "true", "train.max_steps": 2, "train.precision": "bf16", "rl.max_staleness": 1,
        "rl.skip_zero_advantage": "false", "train.save_every": 1})
    assert main(["grpo", "--config", "grpo_tiny", *args]) == 0
    steps = [m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]
    assert [m["step"] for m in steps] == [0, 1]
    for record in steps:
        assert 0.5 < record["routing_agreement"] <= 1.0
        assert abs(record["log_ratio"]) < 1e-2
    queued = json.loads(next(out.glob("checkpoints/*/trainer.json")).read_text())
    text = json.dumps(queued)
    assert '"routed_experts"' in text
