"""Multi-turn rollouts: episodes where the model's turns alternate with an environment's (a tool's output).

An episode is **one sequence**: ``prompt_ids`` (the environment's first conversation, rendered with the chat
template, the tools passed in its ``tools`` argument) then ``completion_ids`` = model turn 1, environment turn 1,
model turn 2, … . The model's tokens are sampled (with their behaviour log-probs) and trained; the environment's
tokens are context only: ``Rollout.loss_mask`` is 0 there, ``logprobs`` hold 0.0 placeholders, and
``rollout_batch`` gives them no label, so they carry no gradient and count in no token normaliser. Nothing is
re-tokenized: each model turn continues from the exact ids of the episode so far (``HFBackend.generate_ids``, or
``VLLMClient.generate_ids`` on the engine), so the trained tokens are the sampled tokens.

**Engines.** ``EpisodeRollouts`` samples with the trainer's live weights in its process (``rollout.engine: hf``);
``EngineEpisodes`` runs the same episode loop against the vLLM engine (``rollout.engine: vllm``): the weights are
synced when due, then the episodes — model turns on the engine, environment steps on local threads — run in the
engine's background thread, so they overlap training with ``rl.max_staleness >= 1``. Held-out evaluation stays
greedy on the trainer's weights (``EpisodeRollouts.evaluate``) with either engine.

**A turn** ends at EOS / end of turn (the final answer: the episode is done), at the tool format's stop string
(a tool call: the environment steps), or at ``env.max_turn_tokens``. The environment's turn is the chat
template's own ``tool`` turn around the observation (found by rendering a sentinel conversation: the end of the
assistant turn, the tool role's header, the observation, the header of the next assistant turn); a template that
cannot render a ``tool`` role gets ``\\n<output>\\n…\\n</output>\\n``.

**Limits**: ``env.max_turns`` model turns; ``rl.max_new_tokens`` tokens after the prompt in all (model and
environment; also capped by ``train.max_length``): a turn is cut to what is left, an observation that does not
fit ends the episode (``finish_reason = "length"``); ``env.wall_clock_s`` per episode and ``env.step_timeout_s``
per environment step. An environment that raises or times out, or an episode past its wall clock, ends with
reward 0 and the reason counted (``env_failure/<reason>`` in the step's metrics); the run goes on. A hung step's
thread cannot be killed from Python: it is abandoned (the built-in tool's sandbox kills its own process tree at
its timeout, so only a user environment can leave one behind).

**Determinism**: model turn ``t`` of sample ``s`` of the prompt with key ``k`` draws from the generator seeded by
``(turn_seed(seed, t), k, s)``; turn 0 uses the single-turn seeds. Environment steps run on ``env.workers``
threads and their results are placed by episode, so an episode's tokens do not depend on timing — as long as the
environment is deterministic (the Python tool is, for code that does not read clocks or randomness).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.data.chat import as_message_dicts, chat_facts, encode_ids, with_implicit_prefix
from posttrain.data.records import Message, RLPrompt
from posttrain.generate.engine import Completion, SamplingParams
from posttrain.generate.sampling import row_seed
from posttrain.rl.rollout import Rollout

__all__ = ["EngineEpisodes", "EpisodeRollouts", "episode_metrics", "episode_reward", "run_episodes", "tool_turn", "turn_seed"]

# generate(prompt_ids, seeds, params) -> one Completion per row (HFBackend.generate_ids)
Generate = Callable[[list[list[int]], list[int], SamplingParams], list[Completion]]

_SENTINEL_ANSWER, _SENTINEL_OBS, _PROBE_USER = "sentinelanswerqx", "sentinelobservationqx", "probeuserqx"
_PLAIN_TOOL_TURN = ("\n<output>\n", "\n</output>\n")


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of model turn ``turn`` (0: ``seed`` itself, so an episode's first turn is a single-turn
    rollout's sample)."""
    return seed if turn == 0 else (seed * 1_000_003 + 104_729 * turn) % (2**31 - 1)


def tool_turn(tokenizer) -> tuple[str, str]:
    """``(before, after)``: the text the chat template writes around a tool observation after an assistant turn
    the model left open (it stopped at a tool call), up to the next assistant turn's header."""
    cached = getattr(tokenizer, "_posttrain_tool_turn", None)
    if cached is not None:
        return cached
    conversation = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _SENTINEL_ANSWER},
                    {"role": "tool", "content": _SENTINEL_OBS}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        start, middle = text.find(_SENTINEL_ANSWER), text.find(_SENTINEL_OBS)
        found = (text[start + len(_SENTINEL_ANSWER) : middle], text[middle + len(_SENTINEL_OBS) :]) \
            if 0 <= start < middle else _PLAIN_TOOL_TURN
    except Exception:  # noqa: BLE001 - a template without a tool role: the plain turn
        found = _PLAIN_TOOL_TURN
    try:
        tokenizer._posttrain_tool_turn = found
    except AttributeError:
        pass
    return found


def episode_prompt_ids(tokenizer, messages: Sequence[Message], tool_format, instructions: bool) -> list[int]:
    """The episode's first ids: ``messages`` rendered with the generation prompt, the tool schema in the template's
    ``tools`` argument; when the template ignores it (and ``instructions``), a system message with the format's
    instructions is put first."""
    conversation = as_message_dicts(messages)
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    if tool_format.tools:
        with_tools = tokenizer.apply_chat_template(conversation, tools=tool_format.tools, tokenize=False,
                                                   add_generation_prompt=True)
        if with_tools != text:
            return with_implicit_prefix(encode_ids(tokenizer, [with_tools])[0], chat_facts(tokenizer).implicit_prefix)
    if instructions and not any(m["role"] == "system" for m in conversation):
        conversation = [{"role": "system", "content": tool_format.instructions}, *conversation]
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return with_implicit_prefix(encode_ids(tokenizer, [text])[0], chat_facts(tokenizer).implicit_prefix)


@dataclass
class Episode:
    item: RLPrompt
    key: int
    sample: int
    env: Any
    prompt_ids: list[int]
    budget: int  # tokens after the prompt, model's and environment's
    started: float
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_s: float = 0.0
    shaping: float = 0.0
    env_tokens: int = 0
    text: str = ""
    finish: str = "length"
    failure: str | None = None
    done: bool = False

    def end(self, finish: str, failure: str | None = None) -> None:
        self.done, self.finish = True, finish
        if failure is not None:
            self.failure = failure

    def rollout(self, temperature: float) -> Rollout:
        info: dict[str, Any] = {"turns": self.turns, "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                                "tool_s": self.tool_s, "shaping": self.shaping, "env_tokens": self.env_tokens}
        if self.failure is not None:
            info["failure"] = self.failure
        return Rollout(prompt_key=self.key, sample_index=self.sample, prompt_ids=self.prompt_ids,
                       completion_ids=self.completion_ids, logprobs=self.logprobs, finish_reason=self.finish,
                       truncated=self.finish == "length", text=self.text, temperature=temperature,
                       loss_mask=self.mask, episode=info)


def _step(env, text: str):
    return env.step(text)


def run_episodes(generate: Generate, tokenizer, items: Sequence[RLPrompt], keys: Sequence[int], params: SamplingParams,
                 config, make_env: Callable[[], Any], *, max_length: int | None = None) -> list[list[Rollout]]:
    """``params.n`` episodes per item, in item order (see the module docstring). ``params``: the sampling (its
    ``max_new_tokens`` is the episode's token budget, its ``seed`` the step's); ``config``: ``env:``; ``make_env()``:
    a fresh environment per episode."""
    from posttrain.rl.tools import TOOL_FORMATS

    tool_format = TOOL_FORMATS.get(config.tool_format)()
    before, after = tool_turn(tokenizer)
    episodes: list[Episode] = []
    for item, key in zip(items, keys, strict=True):
        for sample in range(params.n):
            env, now = None, time.perf_counter()
            try:
                env = make_env()
                messages = env.reset(item)
                prompt_ids = episode_prompt_ids(tokenizer, messages, tool_format, config.instructions)
            except Exception as exc:  # noqa: BLE001 - an environment's failure ends its episode, never the run
                prompt_ids = list(episode_prompt_ids(tokenizer, item.prompt, tool_format, config.instructions))
                failure = f"env_error: {type(exc).__name__}"
            else:
                failure = None
            room = params.max_new_tokens if max_length is None else max_length - len(prompt_ids)
            if room < 1:
                failure = failure or "prompt_too_long"
            # An episode that failed before its first turn still samples one (one token at least), so that it has
            # model tokens to train (with reward 0) and every episode is a trainable sequence.
            episode = Episode(item, key, sample, env, prompt_ids, max(1, min(params.max_new_tokens, room)), now,
                              failure=failure)
            episodes.append(episode)
    # Not a with-block: its exit would wait for a hung environment step, which is abandoned instead.
    pool = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="posttrain-env")
    try:
        for turn in range(config.max_turns):
            active = [e for e in episodes if not e.done]
            if not active:
                break
            _model_turn(generate, tokenizer, active, params, config, turn, tool_format)
            stepping = [e for e in active if not e.done]
            if turn == config.max_turns - 1:  # no model turn would follow: the last turn is the answer
                for episode in stepping:
                    episode.end(episode.finish)
                break
            _env_turn(pool, tokenizer, stepping, config, before, after)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return [[e.rollout(params.temperature) for e in episodes[i * params.n : (i + 1) * params.n]]
            for i in range(len(items))]


def _model_turn(generate: Generate, tokenizer, active: list[Episode], params: SamplingParams, config, turn: int,
                tool_format) -> None:
    by_cap: dict[int, list[Episode]] = {}
    for episode in active:
        by_cap.setdefault(min(config.max_turn_tokens, episode.budget - len(episode.completion_ids)), []).append(episode)
    seed = turn_seed(params.seed, turn)
    for cap, group in sorted(by_cap.items()):
        turn_params = SamplingParams(n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                     max_new_tokens=cap, stop=list(tool_format.stop), seed=seed, logprobs=True)
        completions = generate([e.prompt_ids + e.completion_ids for e in group],
                               [row_seed(seed, e.key, e.sample) for e in group], turn_params)
        for episode, completion in zip(group, completions, strict=True):
            episode.completion_ids += completion.token_ids
            episode.logprobs += list(completion.logprobs or [0.0] * len(completion.token_ids))
            episode.mask += [1] * len(completion.token_ids)
            episode.turns += 1
            episode.finish = completion.finish_reason
            # the whole turn, the call's closing tag included (Completion.text is cut before a stop string)
            episode.text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            if episode.failure is not None:  # failed at reset: this one turn, then reward 0
                episode.end(completion.finish_reason)
            elif completion.finish_reason == "eos":
                episode.text = completion.text
                episode.end("eos")
            elif len(episode.completion_ids) >= episode.budget:
                episode.end("length")


def _env_turn(pool: ThreadPoolExecutor, tokenizer, stepping: list[Episode], config, before: str, after: str) -> None:
    futures = [pool.submit(_step, e.env, e.text) for e in stepping]
    for episode, future in zip(stepping, futures, strict=True):
        left = config.wall_clock_s - (time.perf_counter() - episode.started)
        try:
            result = future.result(timeout=max(min(config.step_timeout_s, left), 0.0))
        except FutureTimeout:
            future.cancel()
            episode.end(episode.finish, "wall_clock" if left <= config.step_timeout_s else "env_timeout")
            continue
        except Exception as exc:  # noqa: BLE001 - an environment's failure ends its episode, never the run
            episode.end(episode.finish, f"env_error: {type(exc).__name__}")
            continue
        info = result.info or {}
        episode.shaping += float(result.reward)
        if info.get("tool_call"):
            episode.tool_calls += 1
            episode.tool_errors += info.get("tool_status", "ok") != "ok"
            episode.tool_s += float(info.get("tool_s", 0.0))
        if result.done:
            episode.end(episode.finish)
            continue
        if time.perf_counter() - episode.started > config.wall_clock_s:
            episode.end(episode.finish, "wall_clock")
            continue
        observation = encode_ids(tokenizer, [before + str(result.observation or "") + after])[0]
        if len(episode.completion_ids) + len(observation) >= episode.budget:  # no room left for a model turn
            episode.end("length")
            continue
        episode.completion_ids += observation
        episode.logprobs += [0.0] * len(observation)
        episode.mask += [0] * len(observation)
        episode.env_tokens += len(observation)


def episode_reward(rollout: Rollout, reward: float, passed: bool | None, counters: Counter) -> tuple[float, bool | None]:
    """An episode's reward from the verdict on its final answer (``reward``, ``passed``): plus the environment's
    per-turn shaping, or 0 (and not passed) when the episode failed — the reason counted in ``counters``."""
    info = rollout.episode or {}
    failure = info.get("failure")
    if failure:
        counters[f"env_failure/{failure}"] += 1
        return 0.0, (None if passed is None else False)
    return reward + float(info.get("shaping", 0.0)), passed


def episode_metrics(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """Per-step figures of multi-turn episodes ({} when there are none): turns per episode, tool calls per episode,
    the share of episodes that called a tool, tool errors and seconds, the share of tokens the environment wrote,
    and the share of episodes that failed."""
    infos = [(r, r.episode) for r in rollouts if r.episode is not None]
    if not infos:
        return {}
    count = len(infos)
    tokens = sum(len(r.completion_ids) for r, _ in infos)
    return {
        "episode/turns_mean": sum(i["turns"] for _, i in infos) / count,
        "episode/tool_calls_mean": sum(i["tool_calls"] for _, i in infos) / count,
        "episode/tool_call_rate": sum(i["tool_calls"] > 0 for _, i in infos) / count,
        "episode/tool_errors": float(sum(i["tool_errors"] for _, i in infos)),
        "episode/tool_error_share": sum(i["tool_errors"] for _, i in infos) / max(1, sum(i["tool_calls"]
                                                                                         for _, i in infos)),
        "episode/tool_s": float(sum(i["tool_s"] for _, i in infos)),
        "episode/env_token_share": sum(i["env_tokens"] for _, i in infos) / max(tokens, 1),
        "episode/failed_share": sum(bool(i.get("failure")) for _, i in infos) / count,
    }


class EpisodeRollouts:
    """The HF engine for episodes: what ``GRPOSource`` calls (``submit(prompts, keys, seed, version)`` with
    ``RLPrompt``s) when the recipe has ``env:``. Samples with the trainer's live weights in its process (under
    FSDP2 gathered once per call, ``full_weights``), like ``HFRollouts``; ``overlaps = False``."""

    overlaps = False

    def __init__(self, root: torch.nn.Module, lm: torch.nn.Module, tokenizer: Any, config, params: SamplingParams,
                 batch_size: int, max_length: int):
        from posttrain.rl.envs import make_env
        from posttrain.rl.tools import TOOL_FORMATS, PythonTool

        self.root, self.lm, self.tokenizer, self.config = root, lm, tokenizer, config
        self.params, self.batch_size, self.max_length = params, batch_size, max_length
        self.log: dict[str, Any] = {}
        # one tool (the sandbox checked once) and one format for every episode of the built-in environment
        shared = {"tool": PythonTool.from_config(config.python), "tool_format": TOOL_FORMATS.get(config.tool_format)()} \
            if not config.name.startswith("python:") else {}
        self.make_env = lambda: make_env(config, **shared)

    def _episodes(self, prompts: Sequence[RLPrompt], keys: Sequence[int], params: SamplingParams) -> list:
        """``run_episodes`` on the live weights (gathered once under FSDP2), in evaluation mode, as sampling is."""
        from posttrain.generate.engine import HFBackend
        from posttrain.rl.rollout import full_weights

        was_training = self.root.training
        self.root.eval()
        try:
            with full_weights(self.root):
                backend = HFBackend(self.lm, self.tokenizer)

                def generate(ids, seeds, turn_params):
                    return backend.generate_ids(ids, seeds, turn_params, batch_size=self.batch_size)

                return run_episodes(generate, self.tokenizer, list(prompts), list(keys), params, self.config,
                                    self.make_env, max_length=self.max_length)
        finally:
            self.root.train(was_training)

    def submit(self, prompts: Sequence[RLPrompt], keys: Sequence[int], seed: int, version: int = 0):
        from posttrain.rl.engines import Ready

        if self.params.greedy:
            raise ValueError("rollouts need sampling (temperature > 0)")
        started = time.perf_counter()
        groups = self._episodes(prompts, keys, SamplingParams(**{**self.params.__dict__, "seed": seed,
                                                                 "logprobs": True}))
        for rollout in (r for group in groups for r in group):
            rollout.version = version
        return Ready(groups, time.perf_counter() - started)

    def evaluate(self, prompts: Sequence[RLPrompt]) -> list[Rollout]:
        """One greedy episode per prompt (held-out evaluation, ``data.eval``): the same environment, tool and limits
        as training, temperature 0 (so no seed matters)."""
        params = SamplingParams(n=1, temperature=0.0, max_new_tokens=self.params.max_new_tokens, logprobs=True)
        return [group[0] for group in self._episodes(prompts, range(len(prompts)), params)]

    def __call__(self, prompts: Sequence[RLPrompt], keys: Sequence[int], seed: int, version: int = 0):
        return self.submit(prompts, keys, seed, version).result()

    def close(self) -> None:
        pass


class EngineEpisodes:
    """Episodes sampled by the vLLM engine (``rollout.engine: vllm`` with ``env:``): what ``GRPOSource`` calls, as
    ``EpisodeRollouts``. ``engine``: the run's ``VLLMRollouts`` (sync, background thread, restart on failure);
    ``local``: the in-process ``EpisodeRollouts``, which evaluates ``data.eval`` and builds the environments."""

    overlaps = True

    def __init__(self, engine: Any, local: EpisodeRollouts):
        self.engine, self.local = engine, local

    @property
    def log(self) -> dict[str, Any]:
        return self.engine.log

    def submit(self, prompts: Sequence[RLPrompt], keys: Sequence[int], seed: int, version: int = 0):
        local = self.local
        if local.params.greedy:
            raise ValueError("rollouts need sampling (temperature > 0)")
        params = SamplingParams(**{**local.params.__dict__, "seed": seed, "logprobs": True})
        prompts, keys = list(prompts), list(keys)

        def job(client) -> tuple[list[list[Rollout]], float]:
            started = time.perf_counter()
            groups = run_episodes(client.generate_ids, local.tokenizer, prompts, keys, params, local.config,
                                  local.make_env, max_length=local.max_length)
            return groups, time.perf_counter() - started

        return self.engine.submit_job(job, version)

    def evaluate(self, prompts: Sequence[RLPrompt]) -> list[Rollout]:
        return self.local.evaluate(prompts)

    def __call__(self, prompts: Sequence[RLPrompt], keys: Sequence[int], seed: int, version: int = 0):
        return self.submit(prompts, keys, seed, version).result()

    def close(self) -> None:
        pass  # the run closes its engine (grpo.py), as it does without env
