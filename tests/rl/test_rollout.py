"""Rollouts from the live policy: sampling-time log-probs equal the training forward's, the batch layout,
determinism across batch sizes, truncation flags, and FSDP2 on 2 ranks (same rollouts, one gather per phase)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from posttrain.data.chat import encode_prompt
from posttrain.generate import SamplingParams
from posttrain.models.load import load_model, load_tokenizer
from posttrain.models.logprobs import IGNORE_INDEX, TokenLogprobModel
from posttrain.rl.rollout import Rollout, completion_logprobs, rollout_batch, sample_rollouts
from tests.train.conftest import ROOT, env

# Prompts of different lengths, so a sampling batch is left-padded; plain text and chat.
PROMPTS = [
    "What is 12 plus 30?",
    "Hi",
    "Sort 3, 1, 2 to get",
    [{"role": "user", "content": "Reverse the word hello"}],
    "The quick brown fox jumps over the lazy dog. Which is larger, 17 or 71?",
]
MAX_NEW = 12


@pytest.fixture(scope="module")
def eos_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model with its EOS logit raised (EOS row of the head along the mean final hidden state), so
    sampled completions end at EOS at different lengths as well as at ``max_new_tokens``."""
    tokenizer = load_tokenizer(tiny_model_dir)
    model = load_model(tiny_model_dir)
    ids = tokenizer(["What is 12 plus 30? The answer is 42. Reverse the word hello"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        mean = model.model(input_ids=ids).last_hidden_state[0].mean(0)
        model.lm_head.weight[tokenizer.eos_token_id] = 5.5 * mean / mean.norm() ** 2
    path = tmp_path_factory.mktemp("eos") / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def policy(eos_model_dir):
    return TokenLogprobModel(load_model(eos_model_dir)), load_tokenizer(eos_model_dir)


def _flat(rollouts: list[list[Rollout]]) -> list[Rollout]:
    return [r for row in rollouts for r in row]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("batch_size", [1, 5])
def test_sampling_logprobs_equal_the_training_forward(policy, temperature, batch_size):
    root, tokenizer = policy
    params = SamplingParams(n=3, temperature=temperature, max_new_tokens=MAX_NEW, seed=5)
    rollouts = _flat(sample_rollouts(root, root.lm, tokenizer, PROMPTS, params, batch_size=batch_size))
    reasons = {r.finish_reason for r in rollouts}
    assert reasons == {"eos", "length"}, reasons  # both, so the training batch is right-padded too
    batch = rollout_batch(rollouts, tokenizer.pad_token_id, temperature)
    with torch.no_grad():
        train_logprobs = completion_logprobs(root, batch, temperature)
    mask = batch["completion_mask"]
    assert int(mask.sum()) == sum(len(r.completion_ids) for r in rollouts)
    assert (train_logprobs[mask] - batch["old_logprobs"][mask]).abs().max() <= 1e-4
    assert torch.all(train_logprobs[~mask] == 0)


def test_recorded_logprobs_are_of_the_tempered_untruncated_distribution(policy):
    """Independent of both code paths: an uncached full forward, logits / T, log-softmax, in float64."""
    root, tokenizer = policy
    temperature = 0.6
    params = SamplingParams(n=2, temperature=temperature, top_p=0.9, top_k=40, max_new_tokens=8, seed=1)
    for rollout in _flat(sample_rollouts(root, root.lm, tokenizer, PROMPTS[:2], params, batch_size=4)):
        ids = torch.tensor([rollout.prompt_ids + rollout.completion_ids])
        with torch.no_grad():
            logits = root.lm(input_ids=ids).logits[0].double() / temperature
        expected = torch.log_softmax(logits, -1)[len(rollout.prompt_ids) - 1 : -1]
        expected = expected.gather(-1, torch.tensor(rollout.completion_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(rollout.logprobs, dtype=torch.float64), expected, atol=1e-4)


def test_rollouts_repeat_per_seed_whatever_the_batch_size_and_split(policy):
    root, tokenizer = policy
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=MAX_NEW, seed=9)
    one = _flat(sample_rollouts(root, root.lm, tokenizer, PROMPTS, params, batch_size=1))
    many = _flat(sample_rollouts(root, root.lm, tokenizer, PROMPTS, params, batch_size=7))
    assert [r.completion_ids for r in one] == [r.completion_ids for r in many]
    for a, b in zip(one, many, strict=True):
        assert a.finish_reason == b.finish_reason and a.text == b.text
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    # A share of the prompts, seeded by their global indices, gets the samples the whole request gave them.
    share = _flat(sample_rollouts(root, root.lm, tokenizer, PROMPTS[3:], params, batch_size=2, prompt_keys=[3, 4]))
    assert [r.completion_ids for r in share] == [r.completion_ids for r in one[9:]]
    assert [(r.prompt_key, r.sample_index) for r in share] == [(k, s) for k in (3, 4) for s in range(3)]
    other = _flat(sample_rollouts(root, root.lm, tokenizer, PROMPTS, SamplingParams(**{**params.__dict__, "seed": 10}),
                                  batch_size=7))
    assert [r.completion_ids for r in other] != [r.completion_ids for r in one]


def test_truncated_flags_and_eos_accounting(policy):
    root, tokenizer = policy
    eos = tokenizer.eos_token_id
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=MAX_NEW, seed=2)
    rollouts = _flat(sample_rollouts(root, root.lm, tokenizer, PROMPTS, params, batch_size=8))
    for r in rollouts:
        assert r.prompt_ids == encode_prompt(tokenizer, PROMPTS[r.prompt_key])
        assert len(r.logprobs) == len(r.completion_ids)
        if r.truncated:
            assert r.finish_reason == "length" and len(r.completion_ids) == MAX_NEW and eos not in r.completion_ids
        else:
            assert r.finish_reason == "eos" and r.completion_ids[-1] == eos  # the EOS is kept: it is trained
            assert eos not in r.completion_ids[:-1] and len(r.completion_ids) <= MAX_NEW
    assert any(r.truncated for r in rollouts) and not all(r.truncated for r in rollouts)
    batch = rollout_batch(rollouts, tokenizer.pad_token_id, 1.0)
    assert batch["truncated"].tolist() == [r.truncated for r in rollouts]


def test_rollout_batch_layout_by_hand():
    def rollout(prompt, completion, logprobs, reason):
        return Rollout(prompt_key=0, sample_index=0, prompt_ids=prompt, completion_ids=completion, logprobs=logprobs,
                       finish_reason=reason, truncated=reason == "length", text="", temperature=0.5)

    rollouts = [rollout([5, 6], [7, 2], [-0.5, -1.5], "eos"), rollout([8], [9, 10, 11], [-1.0, -2.0, -3.0], "length")]
    batch = rollout_batch(rollouts, pad_id=0, temperature=0.5)
    x = IGNORE_INDEX
    assert batch["input_ids"].tolist() == [[5, 6, 7, 2], [8, 9, 10, 11]]
    assert batch["labels"].tolist() == [[x, x, 7, 2], [x, 9, 10, 11]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert batch["completion_mask"].tolist() == [[False, False, True, True], [False, True, True, True]]
    assert batch["old_logprobs"].tolist() == [[0, 0, -0.5, -1.5], [0, -1.0, -2.0, -3.0]]
    assert batch["truncated"].tolist() == [False, True]
    short = rollout_batch([rollout([5], [7], [-0.25], "eos"), rollouts[0]], pad_id=3, temperature=0.5)
    assert short["input_ids"].tolist() == [[5, 7, 3, 3], [5, 6, 7, 2]]
    assert short["labels"].tolist() == [[x, 7, x, x], [x, x, 7, 2]]
    assert short["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert short["old_logprobs"].tolist() == [[0, -0.25, 0, 0], [0, 0, -0.5, -1.5]]
    with pytest.raises(ValueError, match="sampled at temperature 0.5"):
        rollout_batch(rollouts, pad_id=0, temperature=1.0)
    with pytest.raises(ValueError, match="one log-prob per completion token"):
        rollout_batch([rollout([5], [7, 8], [-0.25], "eos")], pad_id=0, temperature=0.5)


def test_training_forward_has_gradients_and_entropy(policy):
    root, tokenizer = policy
    params = SamplingParams(n=2, temperature=0.7, max_new_tokens=6, seed=4)
    rollouts = _flat(sample_rollouts(root, root.lm, tokenizer, PROMPTS[:2], params, batch_size=4))
    batch = rollout_batch(rollouts, tokenizer.pad_token_id, 0.7)
    logprobs, entropy = completion_logprobs(root, batch, 0.7, return_entropy=True)
    mask = batch["completion_mask"]
    (-(logprobs[mask]).mean()).backward()
    grads = [p.grad for p in root.parameters()]
    assert all(g is not None for g in grads) and any(float(g.abs().sum()) > 0 for g in grads)
    root.zero_grad(set_to_none=True)
    # Entropy of softmax(logits / T) at each completion position, against an uncached full forward.
    r = rollouts[0]
    with torch.no_grad():
        logits = root.lm(input_ids=torch.tensor([r.prompt_ids + r.completion_ids])).logits[0].double() / 0.7
    probs = torch.softmax(logits, -1)[len(r.prompt_ids) - 1 : -1]
    expected = -(probs * probs.clamp_min(1e-300).log()).sum(-1)
    assert torch.allclose(entropy[0][mask[0]].double(), expected, atol=1e-4)
    assert not entropy.requires_grad and torch.all(entropy[~mask] == 0)


def test_train_mode_is_restored_and_greedy_is_refused(policy):
    root, tokenizer = policy
    root.train()
    sample_rollouts(root, root.lm, tokenizer, ["Hi"], SamplingParams(n=1, max_new_tokens=2), batch_size=1)
    assert root.training and root.lm.training
    with pytest.raises(ValueError, match="temperature > 0"):
        sample_rollouts(root, root.lm, tokenizer, ["Hi"], SamplingParams(temperature=0.0), batch_size=1)


@pytest.mark.slow
def test_fsdp_two_ranks_match_one_process_and_gather_once_per_phase(eos_model_dir, tmp_path):
    from tests.rl.fsdp_rollouts import FSDP_PROMPTS, fsdp_params

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "tests.rl.fsdp_rollouts", eos_model_dir, str(tmp_path)]
    proc = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]

    root, tokenizer = TokenLogprobModel(load_model(eos_model_dir)), load_tokenizer(eos_model_dir)
    for name, new_tokens in (("short", 4), ("long", 16)):
        reference = {(r.prompt_key, r.sample_index): r for r in _flat(sample_rollouts(
            root, root.lm, tokenizer, FSDP_PROMPTS, fsdp_params(new_tokens), batch_size=10))}
        sharded = [row for record in records for row in record[f"rollouts_{name}"]["rollouts"]]
        assert sorted((row["prompt_key"], row["sample_index"]) for row in sharded) == sorted(reference)
        for row in sharded:
            expected = reference[(row["prompt_key"], row["sample_index"])]
            assert row["completion_ids"] == expected.completion_ids
            assert row["finish_reason"] == expected.finish_reason
            assert max(abs(a - b) for a, b in zip(row["logprobs"], expected.logprobs, strict=True)) <= 1e-5
    tokens = {name: sum(len(row["completion_ids"]) for record in records for row in record[f"rollouts_{name}"]["rollouts"])
              for name in ("short", "long")}
    assert tokens["long"] > 2 * tokens["short"]
    for record in records:
        # One all-gather per FSDP group (root + 2 blocks) per rollout phase, whatever the number of tokens ...
        assert record["rollouts_short"]["all_gathers"] == record["rollouts_long"]["all_gathers"] == 3
        # ... where gathering in each forward grows with them (and shows the counter sees FSDP's gathers).
        assert record["naive_long"]["all_gathers"] > record["naive_short"]["all_gathers"] > 3
        # A training step gathers as it did before the rollout phase: FSDP's settings are restored.
        assert record["train_after"] == record["train_before"] and record["train_before"]["all_gathers"] > 0
        assert record["train_mode_kept"]


def test_host_found_loss_positions_give_the_same_dense_logprobs(policy):
    """GRPOSource's batches carry their loss positions (found on the host); the dense [B, L] layout must be
    the one the device-side mask selection gives."""
    from posttrain.models.logprobs import loss_positions

    root, tokenizer = policy
    params = SamplingParams(n=2, temperature=0.7, max_new_tokens=6, seed=5)
    rollouts = _flat(sample_rollouts(root, root.lm, tokenizer, PROMPTS[:2], params, batch_size=4))
    batch = rollout_batch(rollouts, tokenizer.pad_token_id, 0.7)
    with torch.no_grad():
        on_device, entropy = completion_logprobs(root, batch, 0.7, return_entropy=True)
        on_host, host_entropy = completion_logprobs(root, {**batch, **loss_positions(batch["labels"])}, 0.7,
                                                    return_entropy=True)
    assert torch.equal(on_host, on_device) and torch.equal(host_entropy, entropy)
    assert on_host[batch["completion_mask"]].lt(0).all()  # every completion token got its log-prob
