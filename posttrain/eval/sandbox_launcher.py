"""Sandbox launcher: run as ``python -I -S -B sandbox_launcher.py SPEC.json`` by ``posttrain.eval.sandbox``.

Standard library only (it runs before any sandboxed code and must not import posttrain). It builds the jail,
then executes the untrusted program in it:

1. new network, mount, PID and IPC namespaces (plus a user namespace when not root): no network at all
   (not even loopback is up), a private view of the file system, and a process tree of its own;
2. home directories hidden behind an empty tmpfs (only the Python installation is mounted back), the whole
   file system remounted read-only except the fresh working directory;
3. fork: the child becomes PID 1 of the new PID namespace, so when it exits, or when this launcher is killed
   (PR_SET_PDEATHSIG), the kernel kills every process left in the namespace;
4. the child drops to an unprivileged uid (as root: a fresh uid no other process uses, so RLIMIT_NPROC counts
   only the sandbox's own processes), sets resource limits (CPU seconds, address space, processes, file
   size, open files, no core dumps) and ``no_new_privs``, and execs Python on the program with a scrubbed
   environment.

In ``rlimits`` mode (only when the caller allowed unsandboxed code) steps 1-3 are skipped.
The launcher writes the child's exit status as JSON to ``spec["status_path"]`` (namespaces mode; in rlimits
mode it execs the program itself, so the caller sees the program's own status).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x2, 0x4, 0x8
MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 0x1000, 0x2000, 0x4000, 0x40000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
SYS_MOUNT_SETATTR = 442  # same number on x86_64 and aarch64 (new syscalls share one table)
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SETUP_ERROR_EXIT = 125
SETUP_ERROR_PREFIX = "posttrain-sandbox-setup:"

_libc = ctypes.CDLL(None, use_errno=True)


class MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda s: s.encode() if s is not None else None  # noqa: E731
    _check(_libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
           f"mount {source} -> {target}")


def _mount_setattr(path: str, flags: int, attr_set: int, attr_clr: int) -> None:
    attr = MountAttr(attr_set, attr_clr, 0, 0)
    result = _libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), ctypes.c_uint(flags),
                           ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
    _check(result, f"mount_setattr {path}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def _enter_namespaces(spec: dict) -> None:
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    as_root = os.geteuid() == 0
    outer_uid, outer_gid = os.geteuid(), os.getegid()
    if not as_root:
        flags |= CLONE_NEWUSER
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")
    if not as_root:
        # Map our own uid/gid to themselves: inside, we stay a non-zero uid, so exec drops all capabilities.
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{outer_uid} {outer_uid} 1")
        _write("/proc/self/gid_map", f"{outer_gid} {outer_gid} 1")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)

    # Hide directories such as /root behind an empty tmpfs; mount back only what the interpreter needs.
    for index, mask in enumerate(spec["masks"]):
        staged = []
        for keep_index, keep in enumerate(mask["keep"]):
            stage = os.path.join(spec["stage_dir"], f"{index}-{keep_index}")
            os.makedirs(stage, exist_ok=True)
            _mount(keep, stage, None, MS_BIND | MS_REC)
            staged.append((stage, keep))
        _mount("tmpfs", mask["dir"], "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
        for stage, keep in staged:
            os.makedirs(keep, exist_ok=True)
            _mount(stage, keep, None, MS_MOVE)

    workdir = spec["workdir"]
    _mount(workdir, workdir, None, MS_BIND | MS_REC)
    _mount_setattr("/", AT_RECURSIVE, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0)
    _mount_setattr(workdir, 0, 0, MOUNT_ATTR_RDONLY)


def _limit(kind: int, value: int) -> None:
    resource.setrlimit(kind, (value, value))


def _become_sandboxed(spec: dict, in_namespaces: bool) -> None:
    """Runs in the process that will exec the program. Order matters: drop the uid first (RLIMIT_NPROC is
    charged to the new uid), then limits, then the death signal (a uid change clears it)."""
    if in_namespaces:
        try:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # only the namespace's processes
        except OSError:
            pass  # cosmetic: other processes stay visible but unreachable (other PID namespace, other uid)
    if os.geteuid() == 0 and spec.get("uid") is not None:
        os.setgroups([])
        os.setgid(spec["gid"])
        os.setuid(spec["uid"])
    limits = spec["limits"]
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    _limit(resource.RLIMIT_AS, limits["memory_bytes"])
    _limit(resource.RLIMIT_NPROC, limits["max_processes"])
    _limit(resource.RLIMIT_FSIZE, limits["max_file_bytes"])
    _limit(resource.RLIMIT_NOFILE, limits["max_open_files"])
    _limit(resource.RLIMIT_CORE, 0)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
    if in_namespaces:
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(pdeathsig)")
    os.chdir(spec["workdir"])
    os.umask(0o077)


def _exec_program(spec: dict) -> None:
    python = spec["python"]
    os.execve(python, [python, "-I", "-B", spec["script"]], spec["env"])


def _write_status(status_fd: int, status: int) -> None:
    record = {"exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
              "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None}
    os.write(status_fd, json.dumps(record).encode())
    os.close(status_fd)


def main() -> int:
    with open(sys.argv[1]) as handle:
        spec = json.load(handle)
    in_namespaces = spec["mode"] == "namespaces"
    # Opened before the file system turns read-only: the descriptor keeps the original, writable mount.
    # Python opens it close-on-exec, so the sandboxed program never inherits it.
    status_fd = os.open(spec["status_path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        if in_namespaces:
            _enter_namespaces(spec)
    except OSError as exc:
        print(f"{SETUP_ERROR_PREFIX} {exc}", file=sys.stderr, flush=True)
        return SETUP_ERROR_EXIT

    if not in_namespaces:
        try:
            _become_sandboxed(spec, in_namespaces=False)
        except OSError as exc:
            print(f"{SETUP_ERROR_PREFIX} {exc}", file=sys.stderr, flush=True)
            return SETUP_ERROR_EXIT
        _exec_program(spec)  # the caller sees the program's own exit status

    child = os.fork()
    if child == 0:
        try:
            _become_sandboxed(spec, in_namespaces=True)
            _exec_program(spec)
        except BaseException as exc:  # noqa: BLE001 - any failure before exec is a setup failure
            print(f"{SETUP_ERROR_PREFIX} {exc}", file=sys.stderr, flush=True)
            os._exit(SETUP_ERROR_EXIT)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGKILL))
    _, status = os.waitpid(child, 0)
    _write_status(status_fd, status)
    return 0


if __name__ == "__main__":
    sys.exit(main())
