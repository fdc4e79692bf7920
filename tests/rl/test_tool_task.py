"""The built-in ``tool_use`` task (posttrain.tasks.tool_use) with the real environment, tool and sandbox: a scripted
policy that writes the one Python call the prompt asks for and answers with what the call printed scores 1 on every
family; one that answers without the tool, or misreads the output, scores 0. Only the policy is scripted."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from posttrain.config.loader import load_config
from posttrain.config.rl import GRPORecipe
from posttrain.eval.sandbox import sandbox_support
from posttrain.generate.engine import Completion, SamplingParams
from posttrain.rl.envs import make_env
from posttrain.rl.multiturn import episode_metrics, episode_reward, run_episodes
from posttrain.rl.rewards import RewardFunction
from posttrain.tasks import rl_prompts
from posttrain.tasks.problem import GROUPS, sample_problems

SUPPORTED, WHY = sandbox_support()


def program(question: str) -> str:
    """The Python that answers a tool_use prompt."""
    counting = re.fullmatch(r"How many times does the letter (\w) appear in (\w+)\?", question)
    if counting:
        return f"print({counting.group(2)!r}.count({counting.group(1)!r}))"
    return f"print({question.removeprefix('What is ').removesuffix('?')})"


class ToolUser:
    """A policy stand-in: turn 1 calls the tool with ``program(question)``; turn 2 answers with the number the tool
    printed, plus ``offset`` (``skip_tool``: answers 0 at once)."""

    def __init__(self, tokenizer, offset: int = 0, skip_tool: bool = False):
        self.tokenizer, self.offset, self.skip_tool = tokenizer, offset, skip_tool

    def __call__(self, ids, seeds, params):
        out = []
        for row in ids:
            context = self.tokenizer.decode(row)
            outputs = re.findall(r"<\|tool\|>\n(.*?)<\|eot\|>", context, re.DOTALL)
            if outputs or self.skip_tool:
                number = int(outputs[-1]) + self.offset if outputs else 0
                text = f"The answer is {number}."
                tokens = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
                finish = "eos"
            else:
                question = re.findall(r"<\|user\|>\n(.*?)<\|eot\|>", context, re.DOTALL)[-1]
                text = f"<python>{program(question)}</python>"
                tokens, finish = self.tokenizer.encode(text, add_special_tokens=False), "stop"
            out.append(Completion(text=text, token_ids=tokens, finish_reason=finish, logprobs=[-1.0] * len(tokens)))
        return out


def test_the_tool_use_group_is_opt_in():
    assert "tool_use" not in GROUPS  # not in the default selection, nor in the flywheel eval suite
    assert {p.group for p in sample_problems(30, 0)} == set(GROUPS)
    families = Counter(p.family for p in sample_problems(30, 0, groups=["tool_use"]))
    assert families == {"multiply_large": 10, "long_sum": 10, "count_letter": 10}


@pytest.mark.skipif(not SUPPORTED, reason=f"sandbox unavailable here: {WHY}")
def test_a_correct_tool_call_scores_one_and_a_wrong_answer_zero(tiny_tokenizer, tiny_model_dir, tmp_path):
    prompts = rl_prompts(6, 0, groups=["tool_use"])  # two of each family
    recipe = load_config(GRPORecipe, "grpo_tools_tiny", [f"model.path={tiny_model_dir}", "data.train=x.jsonl",
                                                         f"output_dir={tmp_path}", "reward.workers=0"])
    config = recipe.env
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=recipe.rl.max_new_tokens, seed=3, logprobs=True)
    results = {}
    with RewardFunction(recipe.reward) as rewards:  # the recipe's reward: the numeric verifier on the final answer
        rewards.check_prompts(prompts)
        for name, policy in {"tool": ToolUser(tiny_tokenizer), "misread": ToolUser(tiny_tokenizer, offset=1),
                             "no tool": ToolUser(tiny_tokenizer, skip_tool=True)}.items():
            groups = run_episodes(policy, tiny_tokenizer, prompts, list(range(len(prompts))), params, config,
                                  lambda: make_env(config), max_length=recipe.train.max_length)
            episodes = [group[0] for group in groups]
            scored = rewards.score(prompts, [e.text for e in episodes])
            counters = Counter()
            results[name] = [episode_reward(e, r, p, counters) for e, r, p in zip(episodes, scored.rewards,
                                                                                   scored.passed, strict=True)]
            figures = episode_metrics(episodes)
            assert figures["episode/failed_share"] == 0 and not counters
            assert figures["episode/tool_call_rate"] == (0.0 if name == "no tool" else 1.0)
            assert figures["episode/tool_errors"] == 0.0
    assert results["tool"] == [(1.0, True)] * 6
    assert results["misread"] == [(0.0, False)] * 6
    assert results["no tool"] == [(0.0, False)] * 6
