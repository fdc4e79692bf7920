"""``env:`` of a GRPO recipe: multi-turn episodes with an environment and a sandboxed Python tool (docs/agentic.md).

Absent (the default), GRPO is single-turn: one prompt, one completion. Present, every rollout is an episode
(``posttrain.rl.multiturn``): the model's turns alternate with the environment's (tool output) until the model
answers without a tool call, or a limit ends it. ``rl.max_new_tokens`` is the episode's token budget: the model's
tokens and the environment's together, after the prompt.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from posttrain.config.loader import StrictModel


class PythonToolConfig(StrictModel):
    """``env.python``: the built-in Python tool's sandbox limits (``posttrain.eval.sandbox``, docs/security.md)."""

    timeout_s: float = Field(default=5.0, gt=0, le=600, description="Wall-clock limit of one tool call.")
    cpu_s: int = Field(default=5, ge=1, le=600, description="CPU seconds per process of one call.")
    memory_mb: int = Field(default=512, ge=64, description="Address space per process of one call.")
    max_processes: int = Field(default=8, ge=1, description="Processes one call may start.")
    disk_mb: int = Field(default=16, ge=1, description="What one call may write under /work and /tmp (a tmpfs).")
    max_output_chars: int = Field(default=300, ge=16, description="Output returned to the model: stdout, then "
                                  "the tail of stderr, cut to this many characters (head and tail kept).")
    allow_unsandboxed: bool = Field(default=False, description="Run tool code without the jail where bubblewrap "
                                    "cannot isolate it (resource limits only). Only on a machine you can afford to "
                                    "lose.")


class EnvConfig(StrictModel):
    """``env:`` the environment of multi-turn episodes and its limits."""

    name: str = Field(default="python_tool", description="A registered environment (posttrain.rl.envs.ENVIRONMENTS:"
                      " python_tool) or python:module:Class for your own (constructed as Class(config)).")
    tool_format: Literal["plain", "hermes"] = Field(
        default="plain", description="How tool calls are written: plain <python>code</python> (tiny models), or "
        "hermes <tool_call>{\"name\": \"python\", \"arguments\": {\"code\": ...}}</tool_call> (Qwen/Hermes chat "
        "templates, the tool passed in apply_chat_template's tools argument).")
    max_turns: int = Field(default=4, ge=1, le=64, description="Model turns per episode at most.")
    max_turn_tokens: int = Field(default=64, ge=1, description="Tokens per model turn at most.")
    wall_clock_s: float = Field(default=120.0, gt=0, description="An episode still running after this long ends "
                                "with reward 0 (reason wall_clock).")
    step_timeout_s: float = Field(default=60.0, gt=0, description="One environment step (a tool call included) "
                                  "taking longer ends its episode with reward 0 (reason env_timeout).")
    workers: int = Field(default=4, ge=1, le=64, description="Environment steps (tool calls) run at once.")
    instructions: bool = Field(default=True, description="Add a system message describing the tool call format "
                               "when the chat template does not render the tools itself.")
    tool_call_reward: float = Field(default=0.0, description="Per-turn shaping added for each tool call that ran "
                                    "without error (0: the final verdict alone).")
    tool_error_reward: float = Field(default=0.0, description="Per-turn shaping added for each tool call that "
                                     "failed (malformed, error, timeout, ...); e.g. -0.1.")
    python: PythonToolConfig = Field(default_factory=PythonToolConfig)
    options: dict[str, Any] = Field(default_factory=dict, description="Free-form settings a python:module:Class "
                                    "environment reads from its config.")

    @model_validator(mode="after")
    def _check(self) -> EnvConfig:
        if self.name.startswith("python:"):
            target = self.name[len("python:"):]
            module, _, attr = target.rpartition(":")
            if not module or not attr:
                raise ValueError(f"env.name={self.name!r}: write python:package.module:Class")
            return self
        from posttrain.algorithms.registry import UnknownNameError
        from posttrain.rl.envs import ENVIRONMENTS

        try:
            ENVIRONMENTS.get(self.name)
        except UnknownNameError as exc:
            raise ValueError(f"env.name: {exc} (or python:module:Class for your own)") from None
        return self
