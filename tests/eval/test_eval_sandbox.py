"""Model-written code is untrusted: each escape attempt must be contained, scored as a failure, and the
harness must keep going. Limits are small so the hostile cases stay cheap on a shared machine."""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from posttrain.eval import sandbox, sandbox_jail
from posttrain.eval.harness import evaluate
from posttrain.eval.items import Suite
from posttrain.eval.sandbox import SandboxLimits, SandboxUnavailable, run_python, sandbox_support

from .conftest import roomy_limits

SUPPORTED, WHY = sandbox_support()
needs_sandbox = pytest.mark.skipif(not SUPPORTED, reason=f"sandbox unavailable here: {WHY}")
SMALL = roomy_limits(cpu_s=2, memory_mb=256)


def _alive_with_cmdline(fragment: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    if fragment.encode() in handle.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


@needs_sandbox
def test_good_code_runs_and_can_use_its_directory():
    result = run_python("open('x.txt', 'w').write('hi')\nprint(open('x.txt').read())", SMALL)
    assert result.status == "ok" and result.stdout.strip() == "hi" and result.isolated


@needs_sandbox
def test_infinite_loop_is_stopped():
    result = run_python("while True:\n    pass", SandboxLimits(timeout_s=2.0, cpu_s=1, memory_mb=256))
    assert result.status in ("timeout", "cpu_limit")
    assert result.duration_s < 8


@needs_sandbox
def test_fork_bomb_is_bounded_and_cleaned_up():
    marker = f"{secrets.randbelow(10**6) + 10**6}.5"
    code = textwrap.dedent(f"""
        import os, sys
        while True:
            try:
                if os.fork() == 0:
                    os.execv(sys.executable, [sys.executable, "-S", "-c", "import time; time.sleep({marker})"])
            except OSError:
                pass
    """)
    result = run_python(code, SMALL)
    assert result.status in ("timeout", "cpu_limit", "blocked")
    assert _alive_with_cmdline(f"time.sleep({marker})") == []


@needs_sandbox
def test_crashing_fork_bomb_hits_the_process_limit():
    result = run_python("import os\nwhile True:\n    os.fork()", SMALL)
    assert result.status in ("blocked", "timeout")
    if result.status == "blocked":
        assert "Resource temporarily unavailable" in result.stderr


@needs_sandbox
def test_detached_children_are_killed_at_the_end():
    marker = f"{secrets.randbelow(10**6) + 2 * 10**6}.5"
    code = textwrap.dedent(f"""
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            os.execv(sys.executable, [sys.executable, "-S", "-c", "import time; time.sleep({marker})"])
        time.sleep(0.5)  # the child is running (and would outlive us) by now
        print("parent done")
    """)
    result = run_python(code, SMALL)
    assert result.status == "ok" and result.stdout.strip() == "parent done"
    assert _alive_with_cmdline(f"time.sleep({marker})") == []


@needs_sandbox
def test_memory_hog_is_stopped():
    result = run_python("blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 1024 * 1024))", SMALL)
    assert result.status == "memory"


@needs_sandbox
def test_no_network_the_hosts_loopback_is_unreachable():
    """The jail's network namespace has only its own loopback: a listener on the host's is out of reach."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'x')"
        result = run_python(code, SMALL)
        assert result.status == "blocked" and "Connection refused" in result.stderr, result.stderr
        with pytest.raises(BlockingIOError):
            server.accept()
        outside = run_python("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)", SMALL)
        assert outside.status == "blocked" and "Network is unreachable" in outside.stderr
    finally:
        server.close()


@needs_sandbox
def test_cannot_write_outside_its_directory(tmp_path):
    """/work and /tmp are the jail's own tmpfs; nothing written there, or anywhere, reaches the host."""
    host_tmp = Path("/tmp") / f"posttrain-escape-{secrets.token_hex(4)}"
    for target in [tmp_path / "escaped.txt", Path("../x"), Path("/x"), Path("/usr/lib/x")]:
        result = run_python(f"open({str(target)!r}, 'w').write('pwned')", SMALL)
        assert not result.ok and result.status in ("blocked", "error"), (target, result.stderr)
    inside = run_python(f"open({str(host_tmp)!r}, 'w').write('x')\nprint(open({str(host_tmp)!r}).read())", SMALL)
    assert inside.ok and inside.stdout.strip() == "x"  # the jail's own /tmp works...
    assert not (tmp_path / "escaped.txt").exists() and not host_tmp.exists()  # ...and is not the host's


@needs_sandbox
def test_environment_is_scrubbed_and_home_hidden(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", "hunter2")
    result = run_python("import os, json\nprint(json.dumps(dict(os.environ)))\nprint(os.getuid())", SMALL)
    env_line, uid_line = result.stdout.strip().splitlines()
    assert "hunter2" not in env_line and set(json.loads(env_line)) == {"PATH", "LANG", "HOME", "TMPDIR"}
    assert int(uid_line) != 0
    home = Path.home()
    if home != Path("/"):
        listing = run_python(f"import os\nprint(sorted(os.listdir({str(home)!r})))", SMALL)
        visible = json.loads(listing.stdout.replace("'", '"')) if listing.ok else []
        layout = sandbox_jail.jail_layout()
        needed = {Path(p).relative_to(home).parts[0] for p in (*layout.directories, *layout.files)
                  if home in Path(p).parents}
        assert set(visible) <= needed, visible


@needs_sandbox
def test_harness_scores_escapes_as_failures_and_keeps_going():
    tests = "assert add(2, 3) == 5"
    hostile = {
        "loop": "def add(a, b):\n    while True:\n        pass",
        "fork": "import os\ndef add(a, b):\n    while True:\n        os.fork()",
        "memory": "def add(a, b):\n    x = bytearray(4 * 1024 ** 3)\n    return a + b",
        "socket": "import socket\ndef add(a, b):\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\n    return a + b",
        "write": f"def add(a, b):\n    open('/posttrain-escape-{secrets.token_hex(4)}', 'w').write('x')\n    return a + b",
        "wrong": "def add(a, b):\n    return a - b",
        "good": "```python\ndef add(a, b):\n    return a + b\n```",
    }
    suite = Suite("hostile", [{"id": k, "prompt": "write add", "verifier": "code", "tests": tests, "group": "code"}
                              for k in hostile])
    results = evaluate(hostile, suite, sandbox_limits=SMALL, progress=False, n_boot=200)
    by_id = {row["id"]: row for row in results["items"]}
    assert by_id["good"]["passed"] and by_id["good"]["score"] == 1.0
    for name in hostile.keys() - {"good"}:
        assert not by_id[name]["passed"] and by_id[name]["score"] == 0.0, by_id[name]
    assert "memory" in by_id["memory"]["detail"]
    assert "blocked" in by_id["socket"]["detail"] and "blocked" in by_id["write"]["detail"]
    assert "timed out" in by_id["loop"]["detail"] or "CPU" in by_id["loop"]["detail"]
    assert results["scores"]["groups"]["code"]["score"] == pytest.approx(100 / 7)


def test_refuses_code_without_isolation_unless_allowed(monkeypatch):
    monkeypatch.setattr(sandbox, "sandbox_support", lambda: (False, "no namespaces in this test"))
    monkeypatch.setattr("posttrain.eval.harness.sandbox_support", lambda: (False, "no namespaces in this test"))
    with pytest.raises(SandboxUnavailable, match="allow_unsandboxed_code"):
        run_python("print(1)")
    suite = Suite("s", [{"id": "a", "prompt": "p", "verifier": "code", "tests": "assert f() == 1"}])
    with pytest.raises(SandboxUnavailable, match="allow_unsandboxed_code"):
        evaluate({"a": "def f():\n    return 1"}, suite, progress=False)
    # Allowed: resource limits, fresh directory and scrubbed environment still apply.
    results = evaluate({"a": "def f():\n    return 1"}, suite, progress=False, allow_unsandboxed_code=True)
    assert results["items"][0]["passed"] and "UNSANDBOXED" in results["items"][0]["detail"]
    loop = run_python("while True:\n    pass", SandboxLimits(timeout_s=2, cpu_s=1), allow_unsandboxed=True)
    assert loop.status in ("timeout", "cpu_limit") and not loop.isolated
    hog = run_python("x = bytearray(4 * 1024 ** 3)", SandboxLimits(memory_mb=256), allow_unsandboxed=True)
    assert hog.status == "memory"


UNPRIVILEGED_SCRIPT = """
import json, sys
from posttrain.eval.sandbox import SandboxLimits, run_python, sandbox_support
limits = SandboxLimits(timeout_s=30, cpu_s=2, memory_mb=256, max_processes=16)
print(json.dumps({
    "support": sandbox_support()[0],
    "fork": run_python("import os\\nwhile True:\\n    os.fork()", limits).status,
    "write": run_python("open('/posttrain-unpriv-escape', 'w').write('x')", limits).status,
    "tmp": run_python("open('/tmp/posttrain-unpriv-escape', 'w').write('x')", limits).status,
    "net": run_python("import socket\\nsocket.create_connection(('127.0.0.1', 9), timeout=1)", limits).status,
    "ok": run_python("print('fine')", limits).stdout.strip(),
}))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("unshare"),
                    reason="needs root to start a test process as an unprivileged user")
def test_unprivileged_user_path_with_user_namespace(tmp_path):
    """Non-root users get a user namespace instead of a uid switch; run the same containment as uid 1000."""
    prefix = Path(sys.base_prefix).resolve()
    repo = Path(__file__).resolve().parents[2]
    hidden = next((a for a in reversed(prefix.parents) if a != Path("/") and not os.stat(a).st_mode & 0o001), None)
    stage = tmp_path / "stage"
    stage.mkdir()
    setup = "mount --make-rprivate / && "
    if hidden is not None:  # let uid 1000 reach the interpreter, as the sandbox itself does
        setup += (f"mount --bind {prefix} {stage} && mount -t tmpfs -o mode=0755 tmpfs {hidden} && "
                  f"mkdir -p {prefix} && mount --move {stage} {prefix} && ")
    command = (setup + f"cd {repo} && HOME=/tmp setpriv --reuid=1000 --regid=1000 --clear-groups "
               f"env PYTHONPATH={repo} {sys.executable} -c {shlex.quote(UNPRIVILEGED_SCRIPT)}")
    done = subprocess.run(["unshare", "-m", "sh", "-c", command], capture_output=True, text=True, timeout=120)
    if done.returncode != 0 and "Operation not permitted" in done.stderr:
        pytest.skip(f"cannot set up the unprivileged test user here: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr
    import json

    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"support": True, "fork": "blocked", "write": "blocked", "tmp": "ok", "net": "blocked",
                      "ok": "fine"}
    assert not Path("/tmp/posttrain-unpriv-escape").exists()
