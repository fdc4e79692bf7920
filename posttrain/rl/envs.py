"""Environments of multi-turn episodes: small registered objects with ``reset`` and ``step``.

The protocol (one environment object per episode, made by ``make_env(config)``)::

    messages = env.reset(item)           # the conversation the model starts from (item: an RLPrompt)
    result = env.step(action_text)       # after each model turn: EnvStep(observation, reward, done, info)

- ``observation``: the text of the environment's turn, appended as a ``tool`` turn through the chat template
  (``posttrain.rl.multiturn``); ignored when ``done``.
- ``reward``: per-turn shaping, summed over the episode and added to the final verdict. The verdict itself is the
  recipe's ``reward:`` (the eval verifiers) on the episode's final answer (the last model turn), so rewards reuse
  eval here as in single-turn GRPO.
- ``done``: the episode is over (the model answered without a tool call).
- ``info``: what the step did, counted in the step's metrics: ``tool_call`` (bool), ``tool_status`` (the sandbox
  status, or ``malformed``), ``tool_s`` (seconds).

Limits (turns, tokens, wall clock, per-step timeout) are enforced by the rollout loop, not by the environment;
an environment that raises or exceeds ``env.step_timeout_s`` ends its episode with reward 0 and a counted reason,
never the run.

Register your own with ``@ENVIRONMENTS.register("name")`` on a factory ``f(config) -> Environment``, or name a
class ``python:package.module:Class`` in ``env.name`` (constructed as ``Class(config)``, ``config`` the recipe's
``env:`` section, whose ``options`` dict is free-form).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Protocol

from posttrain.algorithms.registry import Registry
from posttrain.data.records import Message, RLPrompt

__all__ = ["ENVIRONMENTS", "EnvStep", "Environment", "PythonToolEnv", "make_env"]


@dataclass
class EnvStep:
    observation: str | None = None
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    def reset(self, item: RLPrompt) -> list[Message]:
        """The conversation the episode starts from."""
        ...

    def step(self, action_text: str) -> EnvStep:
        """React to the model's turn ``action_text`` (its decoded tokens, the tool call's closing tag included)."""
        ...


ENVIRONMENTS: Registry = Registry("environment")


class PythonToolEnv:
    """``python_tool``: the model may call the built-in Python tool (``posttrain.rl.tools.PythonTool``) between
    turns; a turn without a tool call is its final answer. Any RL prompt works (the recipe's reward scores the
    answer); the instructions say how to call the tool when the chat template does not render ``tools``.

    Shaping: ``env.tool_call_reward`` per call that ran without error, ``env.tool_error_reward`` per failed call.
    """

    def __init__(self, config, tool=None, tool_format=None):
        from posttrain.rl.tools import TOOL_FORMATS, PythonTool

        self.config = config
        self.format = tool_format or TOOL_FORMATS.get(config.tool_format)()
        self.tool = tool if tool is not None else PythonTool.from_config(config.python)

    def reset(self, item: RLPrompt) -> list[Message]:
        return list(item.prompt)

    def step(self, action_text: str) -> EnvStep:
        call = self.format.parse(action_text)
        if call is None:
            return EnvStep(done=True)
        if call.error is not None:
            return EnvStep(f"error: {call.error}", self.config.tool_error_reward,
                           info={"tool_call": True, "tool_status": "malformed", "tool_s": 0.0})
        output = self.tool.run(call.code)
        reward = self.config.tool_call_reward if output.ok else self.config.tool_error_reward
        return EnvStep(output.text, reward, info={"tool_call": True, "tool_status": output.status,
                                                  "tool_s": output.seconds})


ENVIRONMENTS.add("python_tool", PythonToolEnv)


def make_env(config, **shared) -> Environment:
    """A fresh environment for one episode from ``env:`` (``config.name``: registered, or ``python:mod:Class``).
    ``shared`` (e.g. ``tool=``, ``tool_format=``) is passed to registered factories that take it."""
    if config.name.startswith("python:"):
        module_name, _, attr = config.name[len("python:"):].rpartition(":")
        try:
            target = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"env.name={config.name!r}: cannot import it ({type(exc).__name__}: {exc})") from None
        return target(config)
    factory = ENVIRONMENTS.get(config.name)
    accepted = inspect.signature(factory).parameters
    return factory(config, **{key: value for key, value in shared.items() if key in accepted})
