"""What sandboxed code can see and reach: a minimal file system (the interpreter and its standard library,
read-only; a private work dir and /tmp of bounded total size), no host sockets of any kind, no new
namespaces, and a bounded, escaped excerpt of its output in a verdict's detail."""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import posttrain
from posttrain.eval.items import EvalItem
from posttrain.eval.sandbox import SandboxLimits, run_python, sandbox_support
from posttrain.eval.verifiers import VerifySettings, verify

from .conftest import roomy_limits

SUPPORTED, WHY = sandbox_support()
needs_sandbox = pytest.mark.skipif(not SUPPORTED, reason=f"sandbox unavailable here: {WHY}")
SMALL = roomy_limits(memory_mb=256)


@pytest.fixture
def world_readable_dir():
    """A directory under the host's /tmp that any user may read, as other users' files there are."""
    directory = Path(tempfile.mkdtemp(prefix="posttrain-host-", dir="/tmp"))
    directory.chmod(0o755)
    yield directory
    for path in sorted(directory.rglob("*"), reverse=True):
        path.unlink() if not path.is_dir() else path.rmdir()
    directory.rmdir()


def _run_json(code: str, limits: SandboxLimits = SMALL) -> dict:
    result = run_python(code, limits)
    assert result.status == "ok", (result.status, result.stderr[-2000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


READER = textwrap.dedent("""
    import json, os, sys
    paths = json.loads(sys.argv[1] if len(sys.argv) > 1 else {paths!r})
    seen = {{}}
    for path in paths:
        try:
            with open(path, "rb") as handle:
                seen[path] = handle.read(200).decode("utf-8", "replace")
        except OSError as exc:
            seen[path] = f"error: {{type(exc).__name__}}"
    listings = {{}}
    for path in ("/", "/tmp"):
        try:
            listings[path] = sorted(os.listdir(path))
        except OSError as exc:
            listings[path] = f"error: {{type(exc).__name__}}"
    print(json.dumps({{"files": seen, "listings": listings}}))
""")


@needs_sandbox
def test_host_files_are_not_visible(world_readable_dir):
    secret = f"host-secret-{secrets.token_hex(8)}"
    other_users_file = world_readable_dir / "notes.txt"
    other_users_file.write_text(secret)
    suite_file = world_readable_dir / "suite.jsonl"
    suite_file.write_text(json.dumps({"id": "a", "tests": f"assert f() == '{secret}'"}) + "\n")
    for path in (other_users_file, suite_file):
        path.chmod(0o644)
    project_file = Path(posttrain.__file__).resolve()
    paths = [str(other_users_file), str(suite_file), str(project_file), "/etc/passwd", "/etc/hostname"]
    report = _run_json(READER.format(paths=json.dumps(paths)))
    assert secret not in json.dumps(report)
    assert all(text.startswith("error:") for text in report["files"].values()), report["files"]
    assert world_readable_dir.name not in report["listings"]["/tmp"]
    # Nothing else from the host's top level: only the interpreter's own directories, /proc, /dev and the
    # sandbox's private work dir and /tmp.
    allowed = {"usr", "lib", "lib64", "proc", "dev", "tmp", "work", Path(sys.base_prefix).resolve().parts[1]}
    assert set(report["listings"]["/"]) & (set(os.listdir("/")) - allowed) == set(), report["listings"]["/"]


CONNECT = textwrap.dedent("""
    import json, socket
    outcome = {{}}
    for name, address in (("path", {path!r}), ("abstract", {abstract!r})):
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            client.connect(address)
            client.sendall(b"hello from the sandbox")
            outcome[name] = "connected"
        except OSError as exc:
            outcome[name] = f"{{type(exc).__name__}}: {{exc}}"
    print(json.dumps(outcome))
""")


@needs_sandbox
def test_host_unix_sockets_are_unreachable(world_readable_dir):
    path = str(world_readable_dir / "host.sock")
    abstract = f"\0posttrain-test-{secrets.token_hex(6)}"
    servers = []
    for address in (path, abstract):
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(address)
        server.listen(4)
        server.setblocking(False)
        servers.append(server)
    os.chmod(path, 0o777)  # world-writable: any uid on the host may connect to it
    try:
        report = _run_json(CONNECT.format(path=path, abstract=abstract))
        assert report["path"] != "connected" and report["abstract"] != "connected", report
        for server in servers:
            with pytest.raises(BlockingIOError):
                server.accept()
    finally:
        for server in servers:
            server.close()


NAMESPACES = textwrap.dedent("""
    import ctypes, json, os
    libc = ctypes.CDLL(None, use_errno=True)
    NEWNS, NEWUSER, NEWNET, NEWPID = 0x00020000, 0x10000000, 0x40000000, 0x20000000
    SYS_CLONE = {"x86_64": 56, "aarch64": 220}[os.uname().machine]
    def attempt(call):
        pid = os.fork()
        if pid == 0:  # each attempt in a child, so one success cannot change the next attempt
            result = call()
            os._exit(0 if result == 0 else (ctypes.get_errno() or 99))
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)
    def clone_child():
        child = libc.syscall(SYS_CLONE, ctypes.c_ulong(NEWUSER | 17), None, None, None, None)
        if child == 0:
            os._exit(0)
        if child > 0:
            os.waitpid(child, 0)
            return 0
        return -1
    print(json.dumps({
        "unshare user": attempt(lambda: libc.unshare(NEWUSER)),
        "unshare user+mount+net": attempt(lambda: libc.unshare(NEWUSER | NEWNS | NEWNET)),
        "unshare pid": attempt(lambda: libc.unshare(NEWPID)),
        "clone with a new user namespace": attempt(clone_child),
    }))
""")


@needs_sandbox
def test_new_namespaces_are_denied():
    import errno

    report = _run_json(NAMESPACES)
    assert report == {name: errno.EPERM for name in report}, report
    assert len(report) == 4


OUTSIDE_RLIMIT_AS = textwrap.dedent("""
    import ctypes, json, os
    libc = ctypes.CDLL(None, use_errno=True)
    segment = libc.shmget(0, 1 << 20, 0o1000 | 0o600)  # IPC_PRIVATE, IPC_CREAT
    outcome = {"shmget": segment if segment != -1 else -ctypes.get_errno()}
    try:
        os.memfd_create("hoard")
        outcome["memfd_create"] = "created"
    except OSError as exc:
        outcome["memfd_create"] = -exc.errno
    print(json.dumps(outcome))
""")


@needs_sandbox
def test_memory_that_outlives_its_mappings_is_refused():
    import errno

    assert _run_json(OUTSIDE_RLIMIT_AS) == {"shmget": -errno.EPERM, "memfd_create": -errno.EPERM}


DISK = textwrap.dedent("""
    import json, os
    chunk = b"x" * (15 * 1024 * 1024)
    written_mb, errors = 0, []
    for index in range(40):
        target = f"file-{index}" if index % 2 == 0 else os.path.join(os.environ.get("TMPDIR", "."), f"file-{index}")
        try:
            with open(target, "wb") as handle:
                handle.write(chunk)
            written_mb += 15
        except OSError as exc:
            errors.append(exc.errno)
            try:
                os.unlink(target)  # a partly written file still holds space until it is removed
            except OSError:
                pass
    print(json.dumps({"written_mb": written_mb, "errors": sorted(set(errors))}))
""")


@needs_sandbox
def test_total_disk_use_is_capped():
    import errno

    limits = SandboxLimits(timeout_s=30.0, cpu_s=20, memory_mb=512, max_processes=16)
    report = _run_json(DISK, limits)
    cap_mb = getattr(limits, "disk_mb", 64)
    assert report["written_mb"] <= cap_mb, report
    assert report["errors"] == [errno.ENOSPC], report


NOISY = textwrap.dedent("""
    import os, sys
    sys.stdout.write("out " * 2_000_000)
    sys.stderr.write("err " * 2_000_000)
    sys.stderr.flush()
    os.write(2, b"\\xff\\xfe invalid utf-8 \\xc3\\x28\\n")
    def add(a, b):
        raise ValueError("\\x1b[31mred\\x1b[0m bell\\x07 nul\\x00 cr\\r tab\\t \\x9b csi \\udcff " * 5000)
""")


@needs_sandbox
def test_detail_is_a_bounded_escaped_excerpt():
    item = EvalItem(id="add", prompt="write add", verifier="code", group="code", tests="assert add(2, 3) == 5")
    result = verify(item, NOISY, VerifySettings(code_limits=SMALL))
    assert not result.passed
    assert len(result.detail) <= 400, len(result.detail)
    control = [ch for ch in result.detail if ord(ch) < 0x20 or 0x7f <= ord(ch) < 0xa0]
    assert control == [], control
    assert "red" in result.detail and "\\x1b" in result.detail  # escaped, not dropped
    invalid = verify(item, "import os\nos.write(2, b'\\xff\\xfe \\x1b[2J\\n')\nos._exit(1)",
                     VerifySettings(code_limits=SMALL))
    assert not invalid.passed and "\ufffd" not in invalid.detail and "\x1b" not in invalid.detail, invalid.detail
