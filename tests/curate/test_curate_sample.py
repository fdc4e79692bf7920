"""Rejection sampling: verifier-best candidate kept, best-vs-worst pairs, reward-model scorer, funnel."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.config import load_config
from posttrain.curate.config import RewardModelConfig, SampleRecipe
from posttrain.curate.rows import Drop
from posttrain.curate.sample import Sampler, best_and_worst, parse_prompt, rejection_sample
from posttrain.curate.scorers import PromptRecord, RewardModelScorer
from posttrain.data.io import parse_json_line
from posttrain.data.records import PreferencePair, SFTExample
from posttrain.generate import Completion

from .conftest import read_jsonl, write_jsonl


class FixedPolicy:
    """A policy whose candidates are known in advance, so the selection can be checked exactly."""

    def __init__(self, candidates: dict[str, list[str]]):
        self.candidates = candidates

    def generate(self, prompts, params, batch_size=8, progress=True):
        return [[Completion(text, [], "eos") for text in self.candidates[p[-1]["content"]][: params.n]] for p in prompts]


def sample_config(tmp_path, source, *overrides):
    base = [f"data.input={source}", f"output_dir={tmp_path / 'out'}", "policy.path=unused", "progress=false"]
    return load_config(SampleRecipe, None, [*base, *overrides])


def test_best_and_worst_tie_breaking():
    assert best_and_worst([0.0, 1.0, 1.0, 0.0]) == (1, 3)
    assert best_and_worst([None, 2.0, None]) == (1, 1)
    assert best_and_worst([None, None]) is None


def test_keeps_the_verifier_best_candidate_and_emits_pairs(tmp_path):
    source = write_jsonl(tmp_path / "prompts.jsonl", [
        {"id": "p1", "prompt": "What is 40 + 2?", "answer": "42", "verifier": "numeric", "tier": 1},
        {"id": "p2", "prompt": "What is 3 + 4?", "meta": {"answer": "7", "verifier": "numeric"}},
        {"id": "p3", "prompt": "What is 1 + 1?", "answer": "2", "verifier": "numeric"},
        "not json",
    ])  # fmt: skip
    policy = FixedPolicy({
        "What is 40 + 2?": ["41", "The answer is 42", "42", "7"],
        "What is 3 + 4?": ["8", "9", "7", "10"],
        "What is 1 + 1?": ["3", "4", "5", "6"],
    })  # fmt: skip
    config = sample_config(tmp_path, source, "sampling.n=4", "min_score=1.0")
    manifest = rejection_sample(config, Sampler(config, backend=policy))
    out = tmp_path / "out"
    sft = {r["meta"]["sample"]["source_prompt"]: r for r in read_jsonl(out / "sft.jsonl")}
    assert sft["p1"]["messages"][-1]["content"] == "The answer is 42"  # first of the verified-correct ones
    assert sft["p2"]["messages"][-1]["content"] == "7" and sft["p1"]["tier"] == 1
    assert "p3" not in sft  # no candidate passed: below min_score
    pairs = {r["meta"]["source_prompt"]: r for r in read_jsonl(out / "preferences.jsonl")}
    assert pairs["p1"]["chosen"][0]["content"] == "The answer is 42" and pairs["p1"]["rejected"][0]["content"] == "7"
    assert pairs["p1"]["chosen_score"] == 1.0 and pairs["p1"]["rejected_score"] == 0.0
    assert "verifier" in pairs["p1"]["rationale"] and "p3" not in pairs
    for record in sft.values():
        SFTExample.model_validate(record)
    for record in pairs.values():
        PreferencePair.model_validate(record)
    funnel = manifest["funnel"]
    assert funnel["input"] == 4 == funnel["kept"] + funnel["dropped"]
    assert funnel["candidates"] == {"drawn": 12, "kept_as_sft": 2, "rejected": 10}
    assert funnel["pairs"] == {"emitted": 2, "margin_not_above_threshold": 1}
    reasons = {r["reason"] for r in read_jsonl(out / "dropped.jsonl")}
    assert reasons == {"malformed_json", "below_min_score"}


def prompt_of(line: bytes) -> PromptRecord | Drop:
    return parse_prompt(parse_json_line(line), 1)


def test_prompt_parsing_reads_answer_keys_and_rejects_bad_lines():
    prompt = prompt_of(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                                {"role": "assistant", "content": "x"}]}).encode())  # fmt: skip
    assert isinstance(prompt, PromptRecord) and prompt.messages == [{"role": "user", "content": "Hi"}]
    assert not prompt.verifiable
    assert prompt_of(b"\xff").reason == "invalid_utf8"
    assert prompt_of(b"{oops").reason == "malformed_json"
    assert prompt_of(b'{"text": "x"}').reason == "unknown_format"
    assert prompt_of(b'{"prompt": "   "}').reason == "empty_prompt"
    assert prompt_of(b'{"prompt": "q", "tier": 9}').reason == "bad_field"


@pytest.mark.parametrize(
    "record",
    [
        {"prompt": "What is 2 + 2?", "answer": 4, "verifier": "numeric", "tier": 2},
        {"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "meta": {"answer": "4", "verifier": "numeric"}},
        {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4", "verifier": "numeric"},
        {"conversations": [{"from": "human", "value": "What is 2 + 2?"}, {"from": "gpt", "value": "5"}],
         "meta": {"answer": "4", "verifier": "numeric"}},
        {"prompt": "What is 2 + 2?", "completion": "5", "answer": "4", "verifier": "numeric"},
        {"instruction": "What is 2 + 2?", "output": "5", "answer": "4", "verifier": "numeric"},
        {"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5", "answer": "4", "verifier": "numeric"},
    ],
)
def test_any_record_gives_its_prompt_and_answer_key(record):
    prompt = prompt_of(json.dumps(record).encode())
    assert prompt.messages[-1] == {"role": "user", "content": "What is 2 + 2?"}
    assert (prompt.answer, prompt.verifier, prompt.verifiable) == ("4", "numeric", True)


def test_prompts_from_parquet_are_read_through_the_data_layer(tmp_path):
    from posttrain.data.io import write_records
    from posttrain.data.records import RLPrompt

    source = str(tmp_path / "prompts.parquet")
    write_records(source, [RLPrompt(prompt=[{"role": "user", "content": "What is 1 + 1?"}], answer="2",
                                    verifier="numeric", id="p")])  # fmt: skip
    config = sample_config(tmp_path, source, "sampling.n=2")
    manifest = rejection_sample(config, Sampler(config, backend=FixedPolicy({"What is 1 + 1?": ["3", "2"]})))
    kept = read_jsonl(tmp_path / "out" / "sft.jsonl")
    assert [r["messages"][-1]["content"] for r in kept] == ["2"] and manifest["funnel"]["input"] == 1


def test_end_to_end_with_the_tiny_policy_and_judge(tiny_model_dir, tmp_path):
    source = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "Write three fruits."}, {"prompt": "Say hello."}])
    config = sample_config(tmp_path, source, f"policy.path={tiny_model_dir}", "policy.backend=hf", "sampling.n=3",
                           "sampling.max_new_tokens=6", "scorer.kind=judge")  # fmt: skip
    manifest = rejection_sample(config)
    funnel = manifest["funnel"]
    assert funnel["scorers"] == {"judge": 2} and funnel["input"] == funnel["kept"] + funnel["dropped"]
    candidates = read_jsonl(tmp_path / "out" / "candidates.jsonl")
    assert [len(c["candidates"]) for c in candidates] == [3, 3]
    again = rejection_sample(config.model_copy(update={"output_dir": str(tmp_path / "again")}))
    assert again["dataset_id"] == manifest["dataset_id"]  # seeded sampling reproduces


def test_reward_model_scores_the_last_token_and_ignores_padding(tiny_reward_model):
    scorer = RewardModelScorer(RewardModelConfig(path=tiny_reward_model, batch_size=2))
    prompt = [{"role": "user", "content": "Name a fruit."}]
    texts = ["short", "a much longer piece of text than the first one", "mid length text"]
    batched = scorer.score([PromptRecord("q", prompt)], [texts])[0]
    one = scorer.scorer
    for text, score in zip(texts, batched, strict=True):
        ids = torch.tensor([one.encode(prompt, text)])
        with torch.no_grad():  # HF's own forward on the unpadded chat, read at its last token
            manual = one.root.lm(input_ids=ids).logits[0, 0].item()
        assert score == pytest.approx(manual, abs=1e-5)
    assert len(set(batched)) == 3


def test_reward_model_drives_selection(tiny_reward_model, tmp_path):
    source = write_jsonl(tmp_path / "prompts.jsonl", [{"id": "q", "prompt": "Name a fruit."}])
    candidates = ["apple", "banana", "cherry", "a fruit"]
    config = sample_config(tmp_path, source, f"scorer.reward_model.path={tiny_reward_model}", "sampling.n=4")
    rejection_sample(config, Sampler(config, backend=FixedPolicy({"Name a fruit.": candidates})))
    scorer = RewardModelScorer(config.scorer.reward_model)
    expected = scorer.score([PromptRecord("q", [{"role": "user", "content": "Name a fruit."}])], [candidates])[0]
    kept = read_jsonl(tmp_path / "out" / "sft.jsonl")[0]
    assert kept["messages"][-1]["content"] == candidates[max(range(4), key=lambda i: (expected[i], -i))]
    assert kept["meta"]["sample"]["scorer"] == "reward_model"
    assert kept["meta"]["sample"]["scores"] == pytest.approx(expected, abs=1e-5)
