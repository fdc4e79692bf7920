"""Multi-turn episodes (posttrain.rl.multiturn): the loop's bookkeeping (tokens, masks, placeholders, limits) with a
scripted policy, environment failures (crash, hang) scored 0 with a counted reason, masked tokens carrying no
gradient through the GRPO loss, episodes through JSON exactly, the config's refusals, and `posttrain grpo` with
the packaged `grpo_tools_tiny` recipe (with held-out episodes evaluated)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch

from posttrain.config.env import EnvConfig
from posttrain.config.loader import load_config
from posttrain.config.rl import GRPORecipe
from posttrain.data.io import write_records
from posttrain.data.records import RLPrompt, user
from posttrain.eval.sandbox import sandbox_support
from posttrain.generate.engine import Completion, SamplingParams
from posttrain.models.logprobs import IGNORE_INDEX
from posttrain.rl.envs import EnvStep, PythonToolEnv, make_env
from posttrain.rl.multiturn import episode_metrics, episode_reward, run_episodes, tool_turn
from posttrain.rl.offpolicy import decode_rollout, encode_rollout
from posttrain.rl.rollout import Rollout, rollout_batch
from posttrain.tasks import rl_prompts
from tests.rl.conftest import grpo_overrides
from tests.train.conftest import ROOT, read_jsonl
from tests.train.conftest import env as subprocess_env

SUPPORTED, WHY = sandbox_support()
ITEM = RLPrompt(prompt=[user("What is 347 times 29?")], answer="10063", verifier="numeric")


class Scripted:
    """A policy stand-in for the loop's bookkeeping: turn t of every row writes ``turns[t]`` (encoded), with log-prob
    -0.5 per token; a turn ending in the stop string finishes "stop", the last one "eos" (its EOS token appended)."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns, self.calls = tokenizer, turns, []

    def __call__(self, ids, seeds, params):
        self.calls.append((ids, seeds, params))
        out = []
        for _ in ids:
            text = self.turns[min(len(self.calls) - 1, len(self.turns) - 1)]
            tokens = self.tokenizer.encode(text, add_special_tokens=False)[: params.max_new_tokens]
            stop = any(s in text for s in params.stop)
            finish = "stop" if stop else "eos"
            if finish == "eos" and len(tokens) < params.max_new_tokens:
                tokens = tokens + [self.tokenizer.eos_token_id]
            elif not stop:
                finish = "length"
            out.append(Completion(text=text, token_ids=tokens, finish_reason=finish, logprobs=[-0.5] * len(tokens)))
        return out


class EchoEnv:
    """A deterministic environment without the sandbox: a turn with <python>…</python> gets "42" back."""

    def __init__(self, config):
        self.config = config

    def reset(self, item):
        return list(item.prompt)

    def step(self, text):
        if "<python>" in text:
            return EnvStep("42", 0.25, info={"tool_call": True, "tool_status": "ok", "tool_s": 0.01})
        return EnvStep(done=True)


class CrashEnv(EchoEnv):
    def step(self, text):
        raise RuntimeError("boom")


class HangEnv(EchoEnv):
    def step(self, text):
        time.sleep(5)
        return EnvStep(done=True)


def episodes(tokenizer, turns, env_cls=EchoEnv, n=2, budget=120, **config):
    settings = EnvConfig(name="python:tests.rl.test_multiturn:EchoEnv", max_turn_tokens=40, **config)
    policy = Scripted(tokenizer, turns)
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=budget, seed=5, logprobs=True)
    groups = run_episodes(policy, tokenizer, [ITEM], [11], params, settings, lambda: env_cls(settings))
    return groups[0], policy


def test_an_episode_is_one_sequence_with_the_tool_turn_masked(tiny_tokenizer):
    call, answer = "<python>print(347*29)</python>", "The answer is 42"
    group, policy = episodes(tiny_tokenizer, [call, answer])
    ids = lambda text: tiny_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    before, after = tool_turn(tiny_tokenizer)
    assert (before, after) == ("<|eot|>\n<|tool|>\n", "<|eot|>\n<|assistant|>\n")  # the template's own tool turn
    observation = ids(before + "42" + after)
    model_1, model_2 = ids(call), ids(answer) + [tiny_tokenizer.eos_token_id]
    for sample, rollout in enumerate(group):
        assert rollout.sample_index == sample and rollout.prompt_key == 11
        assert rollout.completion_ids == model_1 + observation + model_2
        assert rollout.loss_mask == [1] * len(model_1) + [0] * len(observation) + [1] * len(model_2)
        assert rollout.logprobs == [-0.5] * len(model_1) + [0.0] * len(observation) + [-0.5] * len(model_2)
        assert rollout.text == answer and rollout.finish_reason == "eos"
        assert rollout.episode == {"turns": 2, "tool_calls": 1, "tool_errors": 0, "tool_s": 0.01, "shaping": 0.25,
                                   "env_tokens": len(observation)}
    # turn 2 continues from the exact ids of turn 1 and the observation: nothing re-tokenized
    (first_ids, first_seeds, first_params), (second_ids, second_seeds, _) = policy.calls
    assert second_ids[0] == first_ids[0] + model_1 + observation
    assert first_params.stop == ["</python>"] and len(set(first_seeds + second_seeds)) == 4  # per sample and turn
    batch = rollout_batch(group, 0, 1.0)
    prompt = len(group[0].prompt_ids)
    labels = batch["labels"][0, prompt : prompt + len(group[0].completion_ids)].tolist()
    assert labels == [t if m else IGNORE_INDEX for t, m in zip(group[0].completion_ids, group[0].loss_mask, strict=True)]
    figures = episode_metrics(group)
    assert figures["episode/turns_mean"] == 2 and figures["episode/tool_call_rate"] == 1.0
    assert figures["episode/env_token_share"] == pytest.approx(len(observation) / len(group[0].completion_ids))


def test_limits_end_episodes(tiny_tokenizer):
    call = "<python>print(1)</python>"
    turns, _ = episodes(tiny_tokenizer, [call], max_turns=3)  # calls the tool every turn
    assert turns[0].episode["turns"] == 3 and turns[0].episode["tool_calls"] == 2  # the 3rd call is never run
    assert turns[0].loss_mask[-1] == 1  # it ends on a model turn
    short, _ = episodes(tiny_tokenizer, [call], budget=len(tiny_tokenizer.encode(call)) + 3)
    assert short[0].finish_reason == "length" and short[0].episode["env_tokens"] == 0  # the observation did not fit
    assert len(short[0].completion_ids) <= len(tiny_tokenizer.encode(call)) + 3


@pytest.mark.parametrize("env_cls, reason", [(CrashEnv, "env_error: RuntimeError"), (HangEnv, "env_timeout")])
def test_a_failing_environment_scores_zero_with_its_reason(tiny_tokenizer, env_cls, reason):
    started = time.perf_counter()
    group, _ = episodes(tiny_tokenizer, ["<python>x</python>", "done"], env_cls=env_cls, step_timeout_s=0.3)
    assert time.perf_counter() - started < 4  # a hung step is abandoned, not waited for
    counters = Counter()
    for rollout in group:
        assert rollout.episode["failure"] == reason and sum(rollout.loss_mask) > 0  # still a trainable sequence
        assert episode_reward(rollout, 1.0, True, counters) == (0.0, False)
    assert counters == {f"env_failure/{reason}": 2}
    assert episode_metrics(group)["episode/failed_share"] == 1.0
    ok = Rollout(0, 0, [1], [2], [-0.1], "eos", False, "", 1.0, episode={"shaping": 0.25})
    assert episode_reward(ok, 1.0, True, counters) == (1.25, True)


def test_environments_resolve_by_name_and_by_import():
    config = EnvConfig(name="python:tests.rl.test_multiturn:EchoEnv")
    assert isinstance(make_env(config), EchoEnv)
    with pytest.raises(ValueError, match="nearest|did you mean"):
        EnvConfig(name="python_tools")
    with pytest.raises(ValueError, match="python:package.module:Class"):
        EnvConfig(name="python:nocolon")
    with pytest.raises(ValueError, match="cannot import"):
        make_env(EnvConfig(name="python:no.such.module:Env"))


@pytest.mark.skipif(not SUPPORTED, reason=f"sandbox unavailable here: {WHY}")
def test_the_builtin_environment_runs_calls_in_the_sandbox(tiny_tokenizer):
    config = EnvConfig(tool_error_reward=-0.1, tool_call_reward=0.05)
    env = make_env(config)
    assert isinstance(env, PythonToolEnv) and env.reset(ITEM) == ITEM.prompt
    ran = env.step("<python>print(347 * 29)</python>")
    assert (ran.observation, ran.reward, ran.done) == ("10063\n", 0.05, False)
    assert ran.info["tool_status"] == "ok"
    broken = env.step("<python>print(1")
    assert broken.observation.startswith("error: malformed") and broken.reward == -0.1
    assert env.step("It is 10063.").done


def test_episodes_go_through_json_exactly():
    rollout = Rollout(3, 1, [1, 2], [5, 6, 7, 8], [-0.25, 0.0, 0.0, -1 / 3], "eos", False, "ok", 1.0, version=2,
                      train_logprobs=[-0.2, 0.0, 0.0, -0.3], loss_mask=[1, 0, 0, 1],
                      episode={"turns": 2, "tool_calls": 1, "tool_s": 0.125, "failure": "env_timeout"})
    back = decode_rollout(json.loads(json.dumps(encode_rollout(rollout))))
    assert back == rollout
    data = encode_rollout(rollout)
    for bad in ({**data, "loss_mask": encode_rollout(Rollout(0, 0, [1], [1], [0.0], "eos", False, "", 1.0,
                                                             loss_mask=[1]))["loss_mask"]},
                {**data, "episode": {"turns": [1]}}, {**data, "episode": "x"}):
        with pytest.raises(ValueError, match="loss_mask|episode"):
            decode_rollout(bad)


TOOLS = {"train.max_length": 384, "rl.max_new_tokens": 48, "env.max_turn_tokens": 16}


def config_of(model: str, data: str, out, **extra) -> GRPORecipe:
    return load_config(GRPORecipe, "grpo_tools_tiny", grpo_overrides(model, data, out, **{**TOOLS, **extra}))


def test_tool_tokens_carry_no_gradient(tiny_model_dir, rl_data, tmp_path):
    """The GRPO loss on a hand-made episode: its gradient is that of the model's tokens alone (a hand-written
    surrogate over the trained positions), and differs when the same tokens are all trained (no mask)."""
    from posttrain.models.load import load_model
    from posttrain.models.logprobs import TokenLogprobModel
    from posttrain.rl.source import GRPOSource, Sample
    from posttrain.train.grpo import grpo_loss

    config = config_of(tiny_model_dir, rl_data, tmp_path)
    torch.manual_seed(0)
    lm = load_model(tiny_model_dir, "float32", "eager", False)
    root = TokenLogprobModel(lm, config.train.loss_chunk_size)
    completion, mask = [40, 41, 42, 43, 44, 45, 46, 47], [1, 1, 0, 0, 0, 1, 1, 1]
    behaviour = [-3.0 if m else 0.0 for m in mask]
    masked = Rollout(0, 0, [5, 6, 7], completion, behaviour, "eos", False, "", 1.0, loss_mask=mask)
    unmasked = Rollout(0, 0, [5, 6, 7], completion, behaviour, "eos", False, "", 1.0)

    def gradient(rollout: Rollout) -> torch.Tensor:
        source = GRPOSource.__new__(GRPOSource)
        source.rl, source.pad_id = config.rl, 0
        batch = source.collate([(Sample(rollout, 1.0, None), 1.0)], [True])
        batch["metric_scale"] = 1.0
        lm.zero_grad()
        numerator, _ = grpo_loss(config)(root, batch)
        numerator.backward()
        return torch.cat([p.grad.flatten() for p in lm.parameters()])

    lm.zero_grad()
    ids = torch.tensor([[5, 6, 7, *completion]])
    logprobs = torch.log_softmax(lm(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0][2:]
    keep = torch.tensor(mask, dtype=torch.bool)
    # token_mean numerator of the clipped loss at ratio exp(logp - old): -(ratio * A) summed over trained tokens;
    # with old = -3 far below logp the ratio is clipped above only when A > 0 and ratio > 1 + clip_high
    old = torch.tensor(behaviour)
    ratio = torch.exp(logprobs - old)
    surrogate = -torch.minimum(ratio, torch.clamp(ratio, 1 - 0.2, 1 + 0.28))[keep].sum()
    surrogate.backward()
    expected = torch.cat([p.grad.flatten() for p in lm.parameters()])
    got = gradient(masked)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(gradient(unmasked), got)


def test_the_config_refuses_what_episodes_do_not_support(tiny_model_dir, rl_data, tmp_path):
    assert config_of(tiny_model_dir, rl_data, tmp_path, **{"rollout.engine": "vllm"}).rollout.engine == "vllm"
    with pytest.raises(ValueError, match="routing_replay"):  # episodes do not record their turns' experts yet
        config_of(tiny_model_dir, rl_data, tmp_path, **{"rollout.engine": "vllm", "rl.routing_replay": "true"})
    with pytest.raises(ValueError, match="max_turn"):
        config_of(tiny_model_dir, rl_data, tmp_path, **{"env.max_turnz": 3})
    assert config_of(tiny_model_dir, rl_data, tmp_path, **{"data.eval": rl_data}).data.eval == rl_data  # episodes
    assert config_of(tiny_model_dir, rl_data, tmp_path).env.name == "python_tool"


@pytest.mark.skipif(not SUPPORTED, reason=f"sandbox unavailable here: {WHY}")
def test_grpo_tools_tiny_runs_two_steps(tiny_model_dir, rl_data, tmp_path):
    out = tmp_path / "run"
    held_out = tmp_path / "eval.jsonl"  # the built-in tool task's eval split, evaluated as greedy episodes
    write_records(str(held_out), rl_prompts(3, 0, split="eval", groups=["tool_use"]))
    overrides = grpo_overrides(tiny_model_dir, rl_data, out, **{**TOOLS, "train.max_steps": 2,
                                                                 "data.eval": str(held_out)})
    done = subprocess.run([sys.executable, "-m", "posttrain", "grpo", "--config", "grpo_tools_tiny", *overrides],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 2
    for record in steps:
        assert record["episode/turns_mean"] >= 1 and 0 <= record["episode/tool_call_rate"] <= 1
        assert record["episode/failed_share"] == 0
    evals = [r for r in read_jsonl(out / "metrics.jsonl") if "eval/reward" in r]
    assert len(evals) == 1 and evals[0]["eval/prompts"] == 3 and evals[0]["eval/failed_share"] == 0
    assert evals[0]["eval/turns_mean"] >= 1 and 0 <= evals[0]["eval/tool_call_rate"] <= 1
    assert (out / "final").exists()


# A ChatML template in Qwen 2.5's layout for tools (written here, not copied): the tool schemas in the system turn
# inside <tools>, and a tool message rendered as a *user* turn wrapped in <tool_response>.
QWEN_STYLE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}"
    "\n\n# Tools\n\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\n"
    "Call a function inside <tool_call></tool_call> tags.<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{% elif message.role != 'system' %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class HermesEcho(EchoEnv):
    def step(self, text):
        if "<tool_call>" in text:
            return EnvStep("10063", info={"tool_call": True, "tool_status": "ok", "tool_s": 0.0})
        return EnvStep(done=True)


def test_a_qwen_style_template_gets_its_own_tool_turn_and_the_tool_schema(tiny_model_dir):
    """With the ``hermes`` format on a template that renders ``tools`` and a ``tool`` role (Qwen 2.5's layout): the
    schema goes through ``apply_chat_template(tools=…)`` (no instructions message), the tool turn is the template's
    user-role ``<tool_response>`` block, and it is masked from the loss."""
    from posttrain.models.load import load_tokenizer
    from posttrain.rl.multiturn import episode_prompt_ids
    from posttrain.rl.tools import TOOL_FORMATS

    tokenizer = load_tokenizer(tiny_model_dir)  # its own object: the session's tokenizer keeps its template
    tokenizer.chat_template = QWEN_STYLE
    before, after = tool_turn(tokenizer)
    assert (before, after) == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n",
                               "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    hermes = TOOL_FORMATS.get("hermes")()
    prompt = tokenizer.decode(episode_prompt_ids(tokenizer, ITEM.prompt, hermes, instructions=True))
    assert "<tools>" in prompt and '"name": "python"' in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert hermes.instructions not in prompt  # the template took the schema: no extra system message

    call = '<tool_call>{"name": "python", "arguments": {"code": "print(347 * 29)"}}</tool_call>'
    settings = EnvConfig(name="python:tests.rl.test_multiturn:HermesEcho", tool_format="hermes", max_turn_tokens=80)
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=200, seed=5, logprobs=True)
    policy = Scripted(tokenizer, [call, "10063"])
    [[rollout]] = run_episodes(policy, tokenizer, [ITEM], [0], params, settings, lambda: HermesEcho(settings))
    ids = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    observation = ids(before + "10063" + after)
    model_1, model_2 = ids(call), ids("10063") + [tokenizer.eos_token_id]
    assert policy.calls[0][2].stop == ["</tool_call>"]
    assert rollout.completion_ids == model_1 + observation + model_2
    assert rollout.loss_mask == [1] * len(model_1) + [0] * len(observation) + [1] * len(model_2)
    assert rollout.episode["tool_calls"] == 1 and rollout.episode["turns"] == 2
