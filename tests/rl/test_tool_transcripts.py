"""SFT transcripts of the ``tool_use`` task (``posttrain.tasks.tool_use.tool_transcripts``) are the episodes a correct
policy has, token for token: SFT's tokenisation of a transcript (the real ``posttrain.data.tokenize`` path) equals the
ids of an episode with the same turns, run through the real environment, tool and sandbox (only the policy is
scripted: it replays the transcript's assistant turns), and SFT's labels sit on the model's tokens, never on the
tool's output."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from posttrain.config.loader import load_config
from posttrain.config.rl import GRPORecipe
from posttrain.data.tokenize import IGNORE_INDEX, tokenize_records
from posttrain.eval.sandbox import sandbox_support
from posttrain.generate.engine import Completion, SamplingParams
from posttrain.rl.envs import make_env
from posttrain.rl.multiturn import run_episodes, tool_turn
from posttrain.rl.tools import TOOL_FORMATS
from posttrain.tasks.emit import to_rl
from posttrain.tasks.problem import sample_problems
from posttrain.tasks.tool_use import tool_transcript, tool_transcripts

SUPPORTED, WHY = sandbox_support()
INSTRUCTIONS = TOOL_FORMATS.get("plain")().instructions


class Replay:
    """A policy stand-in that writes the assistant turns of the transcript whose question the row asks: turn ``k``
    after ``k`` tool turns. A turn holding a call stops at its closing tag (as the stop string ends a sampled turn);
    the last one ends with EOS."""

    def __init__(self, tokenizer, turns_by_question: dict[str, list[str]]):
        self.tokenizer, self.turns = tokenizer, turns_by_question

    def __call__(self, ids, seeds, params):
        out = []
        for row in ids:
            context = self.tokenizer.decode(row)
            question = re.findall(r"<\|user\|>\n(.*?)<\|eot\|>", context, re.DOTALL)[-1]
            text = self.turns[question][context.count("<|tool|>")]
            tokens = self.tokenizer.encode(text, add_special_tokens=False)
            if "</python>" in text:
                finish = "stop"
            else:
                tokens, finish = tokens + [self.tokenizer.eos_token_id], "eos"
            out.append(Completion(text=text, token_ids=tokens, finish_reason=finish, logprobs=[-1.0] * len(tokens)))
        return out


def _episodes(tokenizer, model_dir, tmp_path, problems, transcripts):
    recipe = load_config(GRPORecipe, "grpo_tools_tiny", [f"model.path={model_dir}", "data.train=x.jsonl",
                                                         f"output_dir={tmp_path}", "reward.workers=0"])
    config = recipe.env
    policy = Replay(tokenizer, {p.prompt: [m.content for m in t.messages if m.role == "assistant"]
                                for p, t in zip(problems, transcripts, strict=True)})
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=recipe.rl.max_new_tokens, seed=0, logprobs=True)
    groups = run_episodes(policy, tokenizer, [to_rl(p) for p in problems], list(range(len(problems))), params, config,
                          lambda: make_env(config), max_length=recipe.train.max_length)
    return [group[0] for group in groups]


@pytest.mark.skipif(not SUPPORTED, reason=f"sandbox unavailable here: {WHY}")
def test_a_transcript_tokenises_to_the_episode_it_describes(tiny_tokenizer, tiny_model_dir, tmp_path):
    problems = sample_problems(6, 0, groups=["tool_use"])  # two of each family
    transcripts = [tool_transcript(p, INSTRUCTIONS, use_tool=i % 3 != 2) for i, p in enumerate(problems)]
    episodes = _episodes(tiny_tokenizer, tiny_model_dir, tmp_path, problems, transcripts)
    examples, report = tokenize_records(transcripts, tiny_tokenizer, max_length=1024, progress=False)
    assert report.examples == len(transcripts) and report.truncated == 0
    before, _ = tool_turn(tiny_tokenizer)
    end_of_turn = tiny_tokenizer.encode(before, add_special_tokens=False)[0]  # <|eot|>: the tool turn's first token
    for transcript, episode, example in zip(transcripts, episodes, examples, strict=True):
        used_tool = transcript.meta["tool_call"]
        assert episode.episode["tool_calls"] == int(used_tool) and episode.episode["tool_errors"] == 0
        assert episode.finish_reason == "eos" and not episode.episode.get("failure")
        ids = episode.prompt_ids + episode.completion_ids
        # The same ids: SFT's sequence is the episode's plus the template's newline after the last turn (untrained).
        assert example.input_ids[: len(ids)] == ids
        tail = example.input_ids[len(ids):]
        assert tiny_tokenizer.decode(tail) == "\n" and all(label == IGNORE_INDEX for label in example.labels[len(ids):])
        # The loss: SFT trains exactly the episode's model tokens, plus, after a call, the end-of-turn token the
        # template writes to close the call's turn. In the episode that token opens the tool turn (the sampled turn
        # stops at </python>, so a model never writes it there); the tool's output and headers carry no loss.
        trained = [i for i, label in enumerate(example.labels[: len(ids)]) if label != IGNORE_INDEX]
        start = len(episode.prompt_ids)
        model_tokens = [start + i for i, kept in enumerate(episode.loss_mask) if kept]
        env_tokens = [start + i for i, kept in enumerate(episode.loss_mask) if not kept]
        assert bool(env_tokens) == used_tool
        extra = sorted(set(trained) - set(model_tokens))
        assert set(model_tokens) <= set(trained)
        assert extra == ([env_tokens[0]] if used_tool else []) and all(ids[i] == end_of_turn for i in extra)
        assert not set(trained) & set(env_tokens[1:])
        assert all(example.labels[i] == ids[i] for i in trained)


@pytest.mark.skipif(not SUPPORTED, reason=f"sandbox unavailable here: {WHY}")
def test_the_tool_message_holds_what_the_sandboxed_call_prints(tiny_tokenizer, tiny_model_dir, tmp_path):
    """The transcript's tool turn is the real tool's output: the episode's observation decodes to it."""
    problems = sample_problems(3, 1, groups=["tool_use"])
    transcripts = [tool_transcript(p, INSTRUCTIONS) for p in problems]
    episodes = _episodes(tiny_tokenizer, tiny_model_dir, tmp_path, problems, transcripts)
    before, after = tool_turn(tiny_tokenizer)
    for transcript, episode in zip(transcripts, episodes, strict=True):
        env_ids = [t for t, kept in zip(episode.completion_ids, episode.loss_mask, strict=True) if not kept]
        assert tiny_tokenizer.decode(env_ids) == before + transcript.messages[3].content + after


def test_the_mix_has_the_asked_share_of_tool_calls_on_distinct_train_problems():
    transcripts = tool_transcripts(40, 0, INSTRUCTIONS, tool_share=0.25)
    kinds = Counter(t.meta["tool_call"] for t in transcripts)
    assert kinds == {True: 10, False: 30}
    assert len({t.meta["task_key"] for t in transcripts}) == 40
    assert {len(t.messages) for t in transcripts if t.meta["tool_call"]} == {5}
    assert {len(t.messages) for t in transcripts if not t.meta["tool_call"]} == {3}
    assert all(t.messages[0].role == "system" and t.messages[0].content == INSTRUCTIONS for t in transcripts)
    only_tier_one = tool_transcripts(8, 0, None, tool_share=1.0, tiers=[1])
    assert {t.meta["family"] for t in only_tier_one} == {"multiply_large"}
    assert all(t.messages[0].role == "user" for t in only_tier_one)
    with pytest.raises(ValueError, match="tool_share"):
        tool_transcripts(4, 0, INSTRUCTIONS, tool_share=1.5)
