"""Tool calls parsed from model text (hand cases, malformed calls), and the Python tool in the sandbox: its output,
its limits (timeout, no network, no host files, huge output) and the code verifier's gaming cases sent as calls."""

from __future__ import annotations

import pytest

from posttrain.eval.sandbox import SandboxLimits, SandboxUnavailable, sandbox_support
from posttrain.rl.tools import TOOL_FORMATS, PythonTool, truncate

SUPPORTED, WHY = sandbox_support()
needs_sandbox = pytest.mark.skipif(not SUPPORTED, reason=f"sandbox unavailable here: {WHY}")


@pytest.mark.parametrize("text, code, error", [
    ("The answer is 4.", None, None),
    ("let me compute <python>print(6 * 7)</python>", "print(6 * 7)", None),
    ("<python>\nx = 2\nprint(x)\n</python> and more <python>print(1)</python>", "x = 2\nprint(x)", None),
    ("<python>print(1)", None, "malformed: <python> without </python>"),
    ("<python>  </python>", None, "malformed: empty <python></python>"),
])
def test_plain_calls(text, code, error):
    call = TOOL_FORMATS.get("plain")().parse(text)
    if code is None and error is None:
        assert call is None
    else:
        assert (call.code if code else call.error) == (code or error)
        assert call.name == "python"


@pytest.mark.parametrize("text, code, error", [
    ("no call here", None, None),
    ('<tool_call>{"name": "python", "arguments": {"code": "print(2)"}}</tool_call>', "print(2)", None),
    ('<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(3)\\"}"}</tool_call>', "print(3)", None),
    ('<tool_call>{"name": "python", "arguments": {"code": "print(2)"}}', None, "without </tool_call>"),
    ("<tool_call>{name: python}</tool_call>", None, "not JSON"),
    ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', None, "unknown tool 'search'"),
    ('<tool_call>{"name": "python", "arguments": {"src": "x"}}</tool_call>', None, 'non-empty "code"'),
    ('<tool_call>[1, 2]</tool_call>', None, "expected {"),
])
def test_hermes_calls(text, code, error):
    call = TOOL_FORMATS.get("hermes")().parse(text)
    if code is None and error is None:
        assert call is None
    elif code is not None:
        assert call.code == code and call.error is None
    else:
        assert error in call.error


def test_truncate_keeps_head_and_tail_within_the_budget():
    text = "head" + "x" * 1000 + "Traceback: ValueError"
    cut = truncate(text, 100)
    assert len(cut) <= 100 and cut.startswith("head") and cut.endswith("ValueError") and "cut" in cut
    assert truncate("short", 100) == "short"


def test_the_tool_refuses_to_run_without_a_sandbox(monkeypatch):
    import posttrain.rl.tools as tools

    monkeypatch.setattr(tools, "sandbox_support", lambda: (False, "no jail in this test"))
    with pytest.raises(SandboxUnavailable, match="no jail in this test"):
        PythonTool(SandboxLimits())


@pytest.fixture(scope="module")
def tool():
    if not SUPPORTED:
        pytest.skip(f"sandbox unavailable here: {WHY}")
    return PythonTool(SandboxLimits(timeout_s=2, cpu_s=2, memory_mb=256, max_processes=8, disk_mb=8), 120)


@needs_sandbox
def test_output_and_errors_come_back(tool):
    out = tool.run("print(347 * 29)")
    assert out.ok and out.text == "10063\n" and out.seconds > 0
    failed = tool.run("print('before')\nraise ValueError('nope')")
    assert failed.status == "error" and failed.text.startswith("before\n")
    assert "ValueError: nope" in failed.text and failed.text.endswith("[error]")


@needs_sandbox
@pytest.mark.parametrize("code, status", [
    ("while True:\n    pass", {"timeout", "cpu_limit"}),
    ("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)", {"blocked", "error"}),
    ("print(open('/etc/shadow').read())", {"error", "blocked"}),
    ("import os\nos.system('curl http://example.com')\nprint(open('/root/.bashrc').read())", {"error", "blocked"}),
])
def test_the_jail_holds_through_the_tool(tool, code, status):
    out = tool.run(code)
    assert out.status in status, out


@needs_sandbox
def test_huge_output_is_cut_to_the_budget(tool):
    out = tool.run("print('y' * 10_000_000)")
    assert len(out.text) <= 120
    nothing_kept = tool.run("open('/tmp/a', 'w').write('persist')")
    assert nothing_kept.ok
    assert tool.run("print(open('/tmp/a').read())").status == "error"  # a fresh jail per call


@needs_sandbox
def test_gaming_the_verdict_through_the_tool_scores_zero(tool, tmp_path):
    """The code verifier's gaming cases, sent as tool calls: the verdict is computed outside the jail on the final
    answer, so nothing a call does (exit hooks, fake verdict files, patching builtins) reaches it."""
    from posttrain.data.records import RLPrompt, user
    from posttrain.rl.reward_config import RewardConfig
    from posttrain.rl.rewards import RewardFunction

    item = RLPrompt(prompt=[user("Write add(a, b).")], tests="assert add(2, 3) == 5", verifier="code")
    from tests.security.test_code_gaming import SOLUTION_TRICKS

    attempts = ["import atexit, os\natexit.register(lambda: os._exit(0))\nprint('passed')",
                "open('/work/verdict.json', 'w').write('{\"status\": \"ok\"}')\nprint('ok')",
                "import builtins\nbuiltins.AssertionError = Exception\nprint('patched')",
                # and every trick the verifier resists in a solution, run as a call (tests/security/test_code_gaming.py)
                *SOLUTION_TRICKS.values()]
    outputs = [tool.run(code).text for code in attempts]
    config = RewardConfig.model_validate({"terms": [{"kind": "verifier", "weight": 1.0}], "workers": 0})
    with RewardFunction(config) as rewards:
        # the final answer an episode ends with after such calls: the tool's output, not a solution
        scored = rewards.score([item] * len(outputs), outputs)
    assert scored.rewards == [0.0] * len(outputs) and scored.passed == [False] * len(outputs)
