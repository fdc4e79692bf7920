"""Inside the sandbox: set the process up, then run a program, or a code item's solution and its tests.

Started by ``posttrain.eval.sandbox`` as ``python -I -S -B -c "import sandbox_runner; ..." supervise SPEC_FD STATUS_FD``
(inside bubblewrap, or directly when unsandboxed code was allowed). Standard library only. The spec (JSON on
SPEC_FD) carries the mode, the files, the tests, the limits and a per-run nonce; STATUS_FD is where the
verdict goes, and only this process ever holds it (it is not inherited by anything it starts).

Setup, in order: drop to the run's uid (as root: a fresh uid no other process uses), mark this process
non-dumpable (no other process of that uid may read its memory or its ``/proc/PID/fd``), set the resource
limits (inherited by everything started after), write the files into the work dir, report ``ready``.

- ``program``: fork, exec ``python -I -B main.py`` with a scrubbed environment, report its exit status.
- ``tests``: this process is the **test process**. It forks the **solution process** (``solution`` role
  below: a fresh interpreter that runs ``main.py``, then serves the tests' calls over a pair of pipes, see
  ``sandbox_wire.py``), runs the tests with the solution's names bound to references, and reports the
  verdict with the nonce: passed only when the tests ran to their end. The tests never touch the disk and
  never exist in the solution's memory: they arrive here on SPEC_FD, which is closed before the fork, and
  the solution is a new program image (exec) that only ever receives calls. Tests written as
  ``unittest.TestCase`` classes are run here too, and their ``TestResult`` decides (``_UnittestRun``).
"""

from __future__ import annotations

import builtins
import json
import os
import sys

if __package__:  # imported as posttrain.eval.sandbox_runner (tools, tests)
    from .sandbox_wire import Channel, PeerGone, ProtocolError, describe_exception
else:  # inside the jail: the runner's own directory is on sys.path (sandbox_jail.runner_command)
    from sandbox_wire import Channel, PeerGone, ProtocolError, describe_exception

# Imports are a large share of a short run: no signal, socket, types or importlib here (enum, selectors).
CodeType, ModuleType = type(compile("", "", "exec")), type(sys)
SIGKILL, SIGNAL_NAMES = 9, {6: "SIGABRT", 9: "SIGKILL", 11: "SIGSEGV", 15: "SIGTERM", 24: "SIGXCPU", 25: "SIGXFSZ"}
SETUP_ERROR_EXIT = 125
SETUP_ERROR_PREFIX = "posttrain-sandbox-setup:"
PR_SET_DUMPABLE = 4
TESTS_FILENAME = "<tests>"
MAX_FAILURE_CHARS = 2000
MAX_REPORTED_PROBLEMS = 3  # unittest failures named in the verdict's failure text
# Names that may not appear anywhere in a module the test process imports on the solution's say-so: modules
# with side effects on import, and test packages (``test.autotest`` runs CPython's suite, ``unittest.test``
# loads one). Dunder components (``__main__``, ``__phello__``) are refused by ``_importable`` itself.
NEVER_IMPORT = {"antigravity", "this", "idlelib", "turtledemo", "tkinter", "turtle", "__hello__",
                "__phello__", "test", "tests", "idle_test"}


def _setup(spec: dict) -> None:
    """Runs before anything untrusted: uid, non-dumpable, limits, work dir. Order matters: RLIMIT_NPROC is
    charged to the uid, so the uid changes first."""
    import resource

    if spec.get("uid") is not None:
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
    if os.stat("/proc/self").st_uid == os.getuid():  # still dumpable (a uid change already clears it)
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0)")
    limits = spec["limits"]
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    for kind, value in ((resource.RLIMIT_AS, limits["memory_bytes"]), (resource.RLIMIT_NPROC, limits["max_processes"]),
                        (resource.RLIMIT_FSIZE, limits["max_file_bytes"]),
                        (resource.RLIMIT_NOFILE, limits["max_open_files"]), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(kind, (value, value))
    os.chdir(spec["workdir"])
    os.umask(0o077)
    os.makedirs(spec["tmpdir"], exist_ok=True)
    for name, content in spec["files"].items():
        target = os.path.realpath(os.path.join(spec["workdir"], name))
        if not target.startswith(os.path.realpath(spec["workdir"]) + os.sep):
            raise OSError(f"file name {name!r} escapes the work dir")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w", encoding="utf-8") as handle:
            handle.write(content)


def _start(spec: dict, argv: list[str], keep_fds: tuple[int, ...] = ()) -> int:
    """Fork and exec ``python argv`` with the run's environment; the child keeps only ``keep_fds`` beyond
    stdin/stdout/stderr (everything else this process opened is close-on-exec)."""
    pid = os.fork()
    if pid == 0:
        try:
            for fd in keep_fds:
                os.set_inheritable(fd, True)
            os.execve(sys.executable, [sys.executable, *argv], spec["env"])
        except BaseException as exc:  # noqa: BLE001 - nothing may escape a forked child
            os.write(2, f"{SETUP_ERROR_PREFIX} exec failed: {exc}\n".encode())
        os._exit(SETUP_ERROR_EXIT)
    return pid


def _exit_status(status: int) -> dict:
    return {"exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None}


def run_program(spec: dict) -> dict:
    _, status = os.waitpid(_start(spec, ["-I", "-B", "main.py"]), 0)
    return _exit_status(status)


def run_tests(spec: dict) -> dict:
    """The test process: start the solution, run the tests against it, return the verdict."""
    try:
        code = compile(spec["tests"], TESTS_FILENAME, "exec")
    except SyntaxError as exc:
        return _verdict(spec, False, f"the tests do not compile: {exc}", "SyntaxError")
    from_tests, to_solution = os.pipe()  # (read end, write end)
    from_solution, to_tests = os.pipe()
    here = os.path.dirname(os.path.abspath(__file__))
    entry = f"import sys; sys.path.insert(0, {here!r}); import sandbox_runner; sys.exit(sandbox_runner.main(sys.argv))"
    solution = _start(spec, ["-I", "-B", "-c", entry, "solution", str(from_tests), str(to_tests)],
                      keep_fds=(from_tests, to_tests))
    os.close(from_tests)
    os.close(to_tests)
    channel = Channel(from_solution, to_solution, tests_side=True)
    solution_status = None
    try:
        namespace = _namespace(channel, channel.receive(), code)
        suites = _UnittestRun(namespace) if _uses_unittest(code) else None
        exec(code, namespace)
        outcome = suites.finish() if suites else None  # (passed, failure, type), or None: no unittest suite
        if channel.failed:  # the tests swallowed the channel's end (``except BaseException: pass``)
            raise channel.failed
        verdict = _verdict(spec, *(outcome or (True, "", "")))
    except _LoadFailed as exc:
        verdict = _verdict(spec, False, str(exc), exc.kind)
    except PeerGone:
        solution_status = _reap(solution, wait=True)
        how = (f"was killed by {_signal_name(solution_status['signal'])}" if solution_status["signal"]
               else f"exited with code {solution_status['exit_code']}")
        verdict = _verdict(spec, False, f"the solution process {how} before the tests finished", "SolutionExited")
    except ProtocolError as exc:
        verdict = _verdict(spec, False, f"the solution broke the channel to the tests: {exc}", "ProtocolError")
    except BaseException as exc:  # noqa: BLE001 - any way the tests end early is a failure, with its reason
        verdict = _verdict(spec, False, _describe_failure(exc), type(exc).__name__)
    if solution_status is None:  # the tests are over: the solution's fate no longer matters
        _reap(solution, wait=False)
    verdict["solution_signal"] = solution_status["signal"] if solution_status else None
    return verdict


class _LoadFailed(Exception):
    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


def _namespace(channel: Channel, hello: dict, code: CodeType) -> dict:
    """The tests' globals: the solution's names as references (or data), except names of builtins, which
    stay the real builtins (a solution's ``all = lambda *a: True`` must not judge the tests). They are the
    dict of a module that is ``sys.modules["__main__"]`` while the tests run, so what looks a class up by its
    ``__module__`` finds the tests (unittest's ``setUpModule``, dataclasses' string annotations)."""
    body = hello.get("hello")
    if type(body) is not dict:
        raise ProtocolError("the solution did not introduce itself")
    if "load_error" in body:
        error = body["load_error"] if type(body["load_error"]) is dict else {}
        kind = str(error.get("type"))[:80]
        raise _LoadFailed(f"the solution raised {kind} while loading: {str(error.get('message'))[:500]}", kind)
    names = body.get("names")
    if type(names) is not dict:
        raise ProtocolError("the solution sent no names")
    referenced = _names_in(code)
    tests_module = ModuleType("__main__")
    sys.modules["__main__"] = tests_module  # the runner's own ``-c`` module: nothing reads it any more
    namespace = tests_module.__dict__
    namespace["__builtins__"] = builtins
    for name, described in names.items():
        if not name.isidentifier() or name.startswith("__") or hasattr(builtins, name) or type(described) is not dict:
            continue
        if "module" in described:
            module = described["module"]
            if name in referenced and _importable(module):
                try:
                    __import__(module)
                    namespace[name] = sys.modules[module]
                except Exception:  # noqa: BLE001 - the tests will see a NameError if they needed it
                    pass
            continue
        namespace[name] = channel.decode(described.get("value"))
    return namespace


def _importable(module) -> bool:
    """Whether the test process may import ``module`` because the solution bound a name the tests use to a
    module of that name (``import math`` in the solution, ``math`` in the tests). The solution chooses the
    string freely (``types.ModuleType("venv.__main__")``), and importing runs the module's top-level code in
    this, the trusted, process; so only a plain import of a public standard-library module qualifies: a
    dotted name whose top package is in the standard library and whose every component is a public ASCII
    identifier (no ``_``/``__`` prefix: ``unittest.__main__`` runs a test program, ``venv.__main__`` builds a
    venv) and not in ``NEVER_IMPORT`` (``idlelib.idle`` starts IDLE, ``unittest.test`` loads a suite)."""
    if type(module) is not str:
        return False
    parts = module.split(".")
    return (parts[0] in sys.stdlib_module_names and not NEVER_IMPORT.intersection(parts)
            and all(part.isascii() and part.isidentifier() and not part.startswith("_") for part in parts))


def _names_in(code: CodeType) -> set[str]:
    names, stack = set(), [code]
    while stack:
        current = stack.pop()
        names.update(current.co_names)
        stack.extend(const for const in current.co_consts if isinstance(const, CodeType))
    return names


def _uses_unittest(code: CodeType) -> bool:
    """Whether the tests name ``unittest`` (``import unittest``, ``from unittest import TestCase``,
    ``import unittest.mock``): only then is it imported here (imports are a large share of a short run)."""
    return any(name == "unittest" or name.startswith("unittest.") for name in _names_in(code))


class _UnittestRun:
    """The tests' ``unittest.TestCase`` classes, run here into one ``TestResult``, which decides the verdict.

    While the tests run, ``unittest.main`` (and ``unittest.TestProgram``, the same class) is :meth:`main`:
    whatever its arguments, it runs the TestCase classes the tests have defined so far and never exits.
    The real one would run what ``sys.argv`` of this process names and exit (``SystemExit: True`` for a
    correct solution), or with ``exit=False`` report the failures and let the tests reach their end (a pass
    for a wrong solution): neither an exit status nor reaching the end may decide a unittest suite.
    """

    def __init__(self, namespace: dict):
        import unittest

        self.unittest, self.namespace = unittest, namespace
        self.done: set[type] = set()  # TestCase classes already run
        self.used = False  # main() was called: the tests are a unittest suite even with no TestCase found
        self.result = _recording_result(unittest)()
        # The tests' ``unittest`` is the real one even where they rely on the solution's ``import unittest``
        # (a solution's own ``unittest`` object, with a TestCase and a main of its making, would judge).
        namespace["unittest"] = unittest
        for owner in (unittest, sys.modules.get("unittest.main")):
            if owner is not None:
                owner.main = owner.TestProgram = self.main

    def main(self, *args, **kwargs) -> _Program:
        """Stands in for ``unittest.main(...)``: its arguments (``argv``, ``exit``, ``module``,
        ``defaultTest``, ``testRunner``...) are ignored; its ``result`` is the run's one ``TestResult``."""
        self.used = True
        self._run_new_classes()
        return _Program(self.result)

    def finish(self) -> tuple[bool, str, str] | None:
        """After the tests reached their end: run the TestCase classes no ``main()`` call ran, then judge.
        None when the tests are no unittest suite (no TestCase class, no ``main()`` call): they passed by
        reaching their end. Otherwise ``(passed, failure, failure_type)``: passed only when at least one test
        ran and every test that ran passed. A skipped test, an expected failure and an unexpected success are
        not passes: a skip or ``expectedFailure`` checks nothing, and a skip condition can ask the solution
        (``skipUnless(hasattr(solve, "x"))``), which must not choose what is checked."""
        ran_here = self._run_new_classes()
        if not self.used and not ran_here:
            return None
        result = self.result
        problems = [(test, _describe_failure(exc)) for test, exc in result.problems]
        problems += [(test, f"skipped: {reason}") for test, reason in result.skipped]
        problems += [(test, "an expected failure") for test, _ in result.expectedFailures]
        problems += [(test, "an unexpected success") for test in result.unexpectedSuccesses]
        if not problems and result.wasSuccessful():
            return (True, "", "") if result.testsRun else (False, "the unittest suite ran no tests", "NoTests")
        shown = problems[:MAX_REPORTED_PROBLEMS]
        named = "; ".join(f"{_test_name(test)}: {what}" for test, what in shown)
        more = f"; and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
        kind = type(result.problems[0][1]).__name__ if result.problems else "SkippedTest"
        text = f"{result.testsRun} unittest tests ran, not all passed: {named}{more}"
        return False, text[:MAX_FAILURE_CHARS], kind

    def _run_new_classes(self) -> bool:
        """Run the TestCase classes bound at the tests' top level that have not run yet (unittest's own base
        classes aside); True when there were any. Only the tests define classes here: the solution's names
        are data or references, never classes."""
        unittest, loader = self.unittest, self.unittest.TestLoader()
        new = [value for value in list(self.namespace.values())
               if isinstance(value, type) and issubclass(value, unittest.TestCase) and value not in self.done
               and not str(getattr(value, "__module__", "")).startswith("unittest")]
        if not new:
            return False
        self.done.update(new)
        unittest.TestSuite(loader.loadTestsFromTestCase(cls) for cls in dict.fromkeys(new)).run(self.result)
        return True


class _Program:
    """What the stand-in ``unittest.main(...)`` returns: like ``unittest.TestProgram``, it has ``result``."""

    def __init__(self, result):
        self.result = result


def _recording_result(unittest: ModuleType) -> type:
    """A ``unittest.TestResult`` that also keeps each failure's exception (``problems``), so the verdict can
    say where in the tests it happened, as for plain tests."""

    class RecordingResult(unittest.TestResult):
        def __init__(self):
            super().__init__()
            self.problems: list[tuple[object, BaseException]] = []

        def addError(self, test, err):
            self.problems.append((test, err[1]))
            super().addError(test, err)

        def addFailure(self, test, err):
            self.problems.append((test, err[1]))
            super().addFailure(test, err)

        def addSubTest(self, test, subtest, err):
            if err is not None:
                self.problems.append((subtest, err[1]))
            super().addSubTest(test, subtest, err)

    return RecordingResult


def _test_name(test) -> str:
    try:
        name = str(test.id())
    except BaseException:  # noqa: BLE001 - an id built from a subTest's parameters may be a solution object
        name = type(test).__name__
    return name.removeprefix("__main__.")


def _describe_failure(exc: BaseException) -> str:
    line = None
    trace = exc.__traceback__
    while trace is not None:
        if trace.tb_frame.f_code.co_filename == TESTS_FILENAME:
            line = trace.tb_lineno
        trace = trace.tb_next
    try:
        message = str(exc)
    except BaseException:  # noqa: BLE001 - e.g. a message that is a solution object whose process is gone
        message = ""
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return (text + (f" (line {line} of the tests)" if line else ""))[:MAX_FAILURE_CHARS]


def _signal_name(number: int) -> str:
    return SIGNAL_NAMES.get(number, f"signal {number}")


def _verdict(spec: dict, passed: bool, failure: str, failure_type: str) -> dict:
    return {"nonce": spec["nonce"], "passed": passed, "failure": failure, "failure_type": failure_type}


def _reap(pid: int, wait: bool) -> dict:
    if not wait:
        try:
            os.kill(pid, SIGKILL)
        except ProcessLookupError:
            pass
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return {"exit_code": None, "signal": None}
    return _exit_status(status)


def serve_solution(read_fd: int, write_fd: int) -> int:
    """The solution process: run ``main.py``, introduce its names, then answer the tests' requests until
    the test process closes the channel."""
    sys.set_int_max_str_digits(0)
    channel = Channel(read_fd, write_fd, tests_side=False)
    path = os.path.abspath("main.py")
    namespace = {"__name__": "__main__", "__file__": path, "__builtins__": builtins}
    try:
        with open(path, encoding="utf-8") as handle:
            source = handle.read()
        exec(compile(source, path, "exec"), namespace)
    except BaseException as exc:  # noqa: BLE001 - a solution that fails to load is reported, not raised
        import traceback

        traceback.print_exc()
        channel.send({"hello": {"load_error": describe_exception(exc, "load")}})
        return 1
    channel.send({"hello": {"names": _describe_globals(channel, namespace)}})
    try:
        while True:
            channel.serve_one(channel.receive())
            _flush()
    except PeerGone:
        return 0


def _describe_globals(channel: Channel, namespace: dict) -> dict:
    described = {}
    for name, value in list(namespace.items()):
        if type(name) is not str or name.startswith("__"):
            continue
        if type(value) is ModuleType and type(getattr(value, "__name__", None)) is str:
            described[name] = {"module": value.__name__}
            continue
        try:
            described[name] = {"value": channel.encode(value)}
        except (ValueError, RecursionError):
            described[name] = {"value": channel._reference(value)}
    return described


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - the solution may have replaced or closed its streams
            pass


def main(argv: list[str]) -> int:
    if argv[1] == "solution":
        return serve_solution(int(argv[2]), int(argv[3]))
    spec_fd, status_fd = int(argv[2]), int(argv[3])
    with os.fdopen(spec_fd, "rb") as handle:
        spec = json.loads(handle.read())
    # Whatever else was inherited is closed: what this process starts gets stdin/stdout/stderr only.
    os.closerange(3, status_fd)
    os.closerange(status_fd + 1, 1 << 16)
    os.set_inheritable(status_fd, False)
    sys.set_int_max_str_digits(0)
    try:
        _setup(spec)
    except OSError as exc:
        print(f"{SETUP_ERROR_PREFIX} {exc}", file=sys.stderr, flush=True)
        return SETUP_ERROR_EXIT
    os.write(status_fd, b'{"ready": true}\n')
    result = run_program(spec) if spec["mode"] == "program" else run_tests(spec)
    _flush()
    os.write(status_fd, json.dumps(result).encode() + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
