"""Tool calls in the model's text, and the built-in Python tool that runs them in the sandbox.

**Formats** (``TOOL_FORMATS``, chosen by ``env.tool_format``). A model turn that contains a tool call ends at the
call's closing tag (the format's ``stop`` strings end the turn); the environment runs it and appends the output
as a ``tool`` turn (``posttrain.rl.multiturn``).

- ``plain`` (tiny models, no chat-template support needed): ``<python>print(6 * 7)</python>``.
- ``hermes`` (Qwen 2.5/3, Hermes, and other templates with a ``tools`` argument):
  ``<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>``; the tool's JSON schema
  (``PYTHON_TOOL_SCHEMA``) is passed to ``apply_chat_template(tools=...)`` so the template writes its own
  instructions.

``parse(text)`` gives ``None`` (no call: the turn is the final answer) or a ``ToolCall``; a call that is there but
broken (an unterminated tag, JSON that does not parse, an unknown tool, no code) is a ``ToolCall`` with ``error``
set, which the environment reports back to the model as the tool's output and counts as a tool error. Only the
first call of a turn is run (the turn stops at its closing tag anyway).

**The Python tool** (``PythonTool``) runs the code with ``posttrain.eval.sandbox.run_python``: the jail the
``code`` verifier uses (no network, empty read-only root, private /work and /tmp, seccomp, CPU / memory / process /
file limits, wall clock), a fresh one per call, so nothing persists between calls or leaks between episodes. The
code never sees the item's hidden tests or answer: they are not in the jail, and the verdict is computed outside
it, after the episode, from the final answer text. Output returned to the model: stdout, then the tail of stderr
and the status when the run failed, cut to ``max_output_chars`` (head and tail kept).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from posttrain.algorithms.registry import Registry
from posttrain.eval.sandbox import (
    SandboxLimits,
    SandboxSetupError,
    SandboxUnavailable,
    run_python,
    sandbox_support,
)

__all__ = ["PYTHON_TOOL_SCHEMA", "TOOL_FORMATS", "PythonTool", "ToolCall", "ToolFormat", "ToolOutput", "truncate"]

PYTHON_TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python 3 code in a sandbox (no network, no files kept) and return what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "The program."}},
                       "required": ["code"]},
    },
}


@dataclass
class ToolCall:
    """A tool call found in a model turn: ``name`` and ``code``, or ``error`` (why the call cannot run)."""

    name: str
    code: str = ""
    error: str | None = None


@dataclass
class ToolFormat:
    """How one convention writes a tool call: ``stop`` strings end the turn at a call; ``parse`` finds it;
    ``instructions`` tell a model whose template does not render ``tools`` how to call."""

    name: str
    stop: list[str]
    instructions: str
    tools: list[dict[str, Any]] = field(default_factory=list)  # apply_chat_template(tools=...)

    def parse(self, text: str) -> ToolCall | None:
        return _PARSERS[self.name](text)


def _parse_plain(text: str) -> ToolCall | None:
    start = text.find("<python>")
    if start < 0:
        return None
    end = text.find("</python>", start)
    if end < 0:
        return ToolCall("python", error="malformed: <python> without </python>")
    code = text[start + len("<python>") : end].strip("\n")
    if not code.strip():
        return ToolCall("python", error="malformed: empty <python></python>")
    return ToolCall("python", code)


def _parse_hermes(text: str) -> ToolCall | None:
    match = re.search(r"<tool_call>(.*?)(</tool_call>|$)", text, re.DOTALL)
    if match is None:
        return None
    if not match.group(2):
        return ToolCall("?", error="malformed: <tool_call> without </tool_call>")
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError as exc:
        return ToolCall("?", error=f"malformed: the call is not JSON ({exc.msg})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall("?", error='malformed: expected {"name": ..., "arguments": {...}}')
    if call["name"] != "python":
        return ToolCall(call["name"], error=f"unknown tool {call['name']!r}; the only tool is python")
    arguments = call.get("arguments")
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    code = arguments.get("code") if isinstance(arguments, dict) else None
    if not isinstance(code, str) or not code.strip():
        return ToolCall("python", error='malformed: arguments need a non-empty "code" string')
    return ToolCall("python", code)


_PARSERS = {"plain": _parse_plain, "hermes": _parse_hermes}

TOOL_FORMATS: Registry = Registry("tool call format")
TOOL_FORMATS.add("plain", lambda: ToolFormat(
    "plain", ["</python>"],
    "You may run Python to help you: write <python>code</python> and stop; what the code prints comes back in a "
    "tool message. When you know the answer, give it without a tool call."))
TOOL_FORMATS.add("hermes", lambda: ToolFormat(
    "hermes", ["</tool_call>"],
    'You may run Python to help you: write <tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call> '
    "and stop; what the code prints comes back in a tool message. When you know the answer, give it without a "
    "tool call.", [PYTHON_TOOL_SCHEMA]))


@dataclass
class ToolOutput:
    """What a call returned to the model (``text``), its sandbox ``status`` (ok, error, timeout, cpu_limit,
    memory, output_limit, blocked, killed, malformed, setup_error), and how long it took."""

    text: str
    status: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def truncate(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, keeping its head and its tail (where errors are)."""
    if len(text) <= limit:
        return text
    marker = f"\n…[{len(text) - limit} characters cut]…\n"
    keep = max(limit - len(marker), 2)
    head = keep // 2
    return (text[:head] + marker + text[len(text) - (keep - head):])[: max(limit, len(marker) + 2)]


class PythonTool:
    """The built-in ``python`` tool (see the module docstring). Constructing it checks that the sandbox can
    isolate code here, raising ``SandboxUnavailable`` (a setup error: the run must not start) otherwise, unless
    ``allow_unsandboxed``."""

    name = "python"

    def __init__(self, limits: SandboxLimits, max_output_chars: int = 300, allow_unsandboxed: bool = False):
        self.limits, self.max_output_chars, self.allow_unsandboxed = limits, max_output_chars, allow_unsandboxed
        supported, why = sandbox_support()
        if not supported and not allow_unsandboxed:
            raise SandboxUnavailable(f"the python tool cannot isolate code here ({why}); refusing to run model-written "
                                     "code. Set env.python.allow_unsandboxed=true only on a machine you can afford "
                                     "to lose.")

    @classmethod
    def from_config(cls, config) -> PythonTool:
        """From ``env.python`` (``posttrain.config.env.PythonToolConfig``)."""
        limits = SandboxLimits(timeout_s=config.timeout_s, cpu_s=config.cpu_s, memory_mb=config.memory_mb,
                               max_processes=config.max_processes, disk_mb=config.disk_mb,
                               max_output_chars=max(config.max_output_chars * 4, 1024))
        return cls(limits, config.max_output_chars, config.allow_unsandboxed)

    def run(self, code: str) -> ToolOutput:
        started = time.perf_counter()
        try:
            result = run_python(code, self.limits, allow_unsandboxed=self.allow_unsandboxed)
        except SandboxSetupError as exc:  # the jail could not be built this time: the call fails, the run goes on
            return ToolOutput(f"error: the sandbox failed ({str(exc)[:200]})", "setup_error",
                              time.perf_counter() - started)
        text = result.stdout
        if not result.ok:
            tail = result.stderr.strip().splitlines()[-3:]
            text = (text + ("\n" if text and not text.endswith("\n") else "") + "\n".join(tail)
                    + f"\n[{result.status}]")
        return ToolOutput(truncate(text, self.max_output_chars), result.status, time.perf_counter() - started)
