"""The jail's shape: the bubblewrap command line, the file system view it builds, and the seccomp filter.

Why bubblewrap (Debian's ``bubblewrap``, the sandbox under Flatpak): it builds the jail from an *empty*
root (a tmpfs, then ``pivot_root``), so the view holds only what is named here, instead of hiding parts of
the host's tree one mount at a time; it creates the namespaces, ``--die-with-parent``, ``--new-session``,
``no_new_privs`` and a seccomp filter in one well-reviewed C program; it runs unprivileged (user namespace)
and as root. The code this replaced was our own ``ctypes`` calls to ``unshare``/``mount``/``mount_setattr``
over the host's whole file system, which is what let sandboxed code read every world-readable file.

The view, all read-only except /work: the interpreter binary; the directories of the shared libraries it
and its standard library's extension modules load (as ``/proc/self/maps`` of a probe reports them), which
includes the standard library itself, with ``site-packages`` covered by an empty directory; the symlinks on
the way to them (``/lib64 -> usr/lib64``, ...); the runner's two files and their bytecode at /runner; a
private /proc and a minimal /dev; /work, a tmpfs of ``disk_mb`` that is the work dir, HOME and (through the
``/tmp`` symlink) TMPDIR. Nothing of the host's /tmp, /home, /etc, the project or its data.

The seccomp filter answers EPERM to: new namespaces (``unshare``, ``setns``, ``clone`` with any
``CLONE_NEW*`` flag; ``clone3``, whose flags a filter cannot read, gets ENOSYS so libc falls back to
``clone``), mounts, ``ptrace`` and ``process_vm_readv/writev`` (the test process's memory stays its own),
keyrings, ``bpf``, ``perf_event_open``, ``userfaultfd`` and ``io_uring`` (kernel attack surface no
Python program needs), ``shmget`` and ``memfd_create`` (memory outside the address-space limit). Another
architecture's syscalls (x32, i386) kill the process.
"""

from __future__ import annotations

import atexit
import os
import platform
import py_compile
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

WORKDIR = "/work"
TMPDIR = "/work/.tmp"
RUNNER_DIR = "/runner"
RUNNER_FILES = ("sandbox_runner.py", "sandbox_wire.py")
HERE = Path(__file__).resolve().parent


_runner_dirs: list[str] = []


def runner_dir() -> str:
    """A directory with the runner's two files and their bytecode, made once per process (and again if a
    /tmp cleaner removed it); the jail gets it read-only at /runner. Compiling them on every run cost each
    of a run's two interpreters ~8 ms of CPU: ``-B`` never writes bytecode, and a read-only bind could not
    hold it anyway."""
    if _runner_dirs and all(os.path.isfile(_cached(os.path.join(_runner_dirs[-1], n))) for n in RUNNER_FILES):
        return _runner_dirs[-1]
    directory = tempfile.mkdtemp(prefix="posttrain-sandbox-runner-")
    atexit.register(_remove_if_creator, directory, os.getpid())  # not from a forked child's exit
    os.mkdir(os.path.join(directory, "__pycache__"))
    for name in RUNNER_FILES:
        target = os.path.join(directory, name)
        shutil.copy2(HERE / name, target)
        py_compile.compile(target, cfile=_cached(target), doraise=True)
    for root, dirs, files in os.walk(directory):  # the run's uid reads them; nobody else may write them
        for entry in dirs + files:
            os.chmod(os.path.join(root, entry), 0o755 if entry in dirs else 0o644)
    os.chmod(directory, 0o755)
    _runner_dirs.append(directory)
    return directory


def _remove_if_creator(directory: str, creator: int) -> None:
    if os.getpid() == creator:
        shutil.rmtree(directory, ignore_errors=True)


def runner_command(python: str, directory: str) -> list[str]:
    """The interpreter on the runner, imported (so its cached bytecode is used) rather than run as a script."""
    return [python, "-I", "-S", "-B", "-c",
            f"import sys; sys.path.insert(0, {directory!r}); import sandbox_runner; sys.exit(sandbox_runner.main(sys.argv))"]


def _cached(path: str) -> str:
    import importlib.util

    return importlib.util.cache_from_source(path)


@dataclass(frozen=True)
class JailLayout:
    python: str  # the interpreter (the base one, never a virtualenv's), at the same path inside as outside
    directories: tuple[str, ...]  # bound read-only at the same path
    covered: tuple[str, ...]  # directories inside those, covered by an empty read-only tmpfs
    symlinks: tuple[tuple[str, str], ...]  # (link, target) recreated inside as on the host
    files: tuple[str, ...]  # single files bound read-only at the same path


def interpreter() -> str:
    """The base interpreter: a virtualenv's ``bin/python`` is a symlink to it plus a ``pyvenv.cfg`` that
    would put the virtualenv's packages in reach; the sandbox gets the standard library only."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


_MAPS_PROBE = """
import importlib, os, sys, sysconfig
dynload = os.path.join(sysconfig.get_paths()["stdlib"], "lib-dynload")
for name in sorted(os.listdir(dynload)) if os.path.isdir(dynload) else []:
    try:
        importlib.import_module(name.split(".")[0])
    except BaseException:
        pass
for line in open("/proc/self/maps"):
    fields = line.split(None, 5)
    if len(fields) == 6 and fields[5].startswith("/"):
        print(fields[5].rstrip("\\n"))
"""


@lru_cache(maxsize=1)
def jail_layout() -> JailLayout:
    """Probe once per process what the interpreter needs (about 0.2 s)."""
    python = interpreter()
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    mapped = subprocess.run([python, "-I", "-S", "-c", _MAPS_PROBE], capture_output=True, text=True,
                            timeout=60, check=True, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}).stdout
    needed = {path for path in mapped.splitlines() if os.path.isfile(path)} | {_elf_interpreter(python)}
    directories: set[str] = {stdlib}
    symlinks: dict[str, str] = {}
    for path in sorted(needed - {python}):
        _reach(path, directories, symlinks)
    _reach(python, set(), symlinks)  # symlinks on the way to the interpreter; the file itself is bound alone
    kept = sorted(d for d in directories if not _inside(d, directories))
    # A symlink inside a bound directory comes with it; only the others (e.g. /lib64) are recreated.
    symlinks = {link: target for link, target in symlinks.items() if not _inside(link, kept)}
    covered = sorted({os.path.join(stdlib, "site-packages"), os.path.join(stdlib, "dist-packages")}
                     & {d for d in _subdirs(stdlib)})
    return JailLayout(python, tuple(kept), tuple(covered), tuple(sorted(symlinks.items())), (python,))


def _inside(path: str, directories) -> bool:
    return any(path != d and path.startswith(d.rstrip("/") + "/") for d in directories)


def _subdirs(directory: str) -> list[str]:
    try:
        return [entry.path for entry in os.scandir(directory) if entry.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _reach(path: str, directories: set[str], symlinks: dict[str, str], depth: int = 0) -> None:
    """Make ``path`` resolve inside the jail as on the host: recreate each symlink met on the way and bind
    the directory that finally holds the file."""
    if depth > 16:
        raise RuntimeError(f"too many symlinks on the way to {path}")
    parts = Path(os.path.abspath(path)).parts
    current = "/"
    for index, part in enumerate(parts[1:], start=1):
        step = os.path.join(current, part)
        if os.path.islink(step):
            target = os.readlink(step)
            if index < len(parts) - 1:  # a directory symlink such as /lib64 -> usr/lib64: recreate it
                symlinks.setdefault(step, target)
                resolved = os.path.normpath(os.path.join(current, target))
                _reach(os.path.join(resolved, *parts[index + 1:]), directories, symlinks, depth + 1)
                return
            directories.add(current)  # the link itself lives in this directory; then follow it
            _reach(os.path.normpath(os.path.join(current, target)), directories, symlinks, depth + 1)
            return
        current = step
    directories.add(os.path.dirname(current))


def _elf_interpreter(binary: str) -> str:
    """The program interpreter (``PT_INTERP``, e.g. /lib64/ld-linux-x86-64.so.2) named in an ELF file: the
    kernel opens it by that path, so it must exist inside."""
    with open(binary, "rb") as handle:
        header = handle.read(64)
        if header[:4] != b"\x7fELF":
            raise RuntimeError(f"{binary} is not an ELF executable")
        wide, order = header[4] == 2, "<" if header[5] == 1 else ">"
        if wide:
            phoff, phentsize, phnum = struct.unpack_from(order + "Q", header, 32)[0], *struct.unpack_from(order + "HH", header, 54)
        else:
            phoff, phentsize, phnum = struct.unpack_from(order + "I", header, 28)[0], *struct.unpack_from(order + "HH", header, 42)
        for index in range(phnum):
            handle.seek(phoff + index * phentsize)
            entry = handle.read(phentsize)
            if struct.unpack_from(order + "I", entry, 0)[0] == 3:  # PT_INTERP
                offset, size = (struct.unpack_from(order + "QQ", entry, 8)[0], struct.unpack_from(order + "Q", entry, 32)[0]) \
                    if wide else (struct.unpack_from(order + "I", entry, 4)[0], struct.unpack_from(order + "I", entry, 16)[0])
                handle.seek(offset)
                return handle.read(size).rstrip(b"\0").decode()
    raise RuntimeError(f"{binary} names no program interpreter (a static build?)")


def bwrap_command(bwrap: str, layout: JailLayout, disk_bytes: int, as_root: bool, seccomp_fd: int,
                  info_fd: int) -> list[str]:
    """``bwrap`` and its options; the command to run inside follows. That command is the jail's PID 1
    (``--as-pid-1``): when it exits, the kernel kills every process left in the namespace before bubblewrap
    sees the exit, and no process inside can signal it (a PID 1 ignores its namespace's signals). As root, bubblewrap keeps only
    CAP_SETUID/CAP_SETGID so the runner can drop to the run's fresh uid (after which it has no capability
    at all); as a normal user it runs unprivileged in a new user namespace."""
    command = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup",
               "--hostname", "sandbox", "--die-with-parent", "--new-session", "--as-pid-1", "--clearenv",
               "--setenv", "LANG", "C.UTF-8", "--seccomp", str(seccomp_fd), "--info-fd", str(info_fd)]
    if as_root:
        command += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        command += ["--unshare-user"]
    # bubblewrap creates missing parents as 0700 root; the run's uid must be able to pass through them.
    bound = [*layout.directories, *layout.files, *(link for link, _ in layout.symlinks), RUNNER_DIR]
    for parent in sorted({str(p) for path in bound for p in Path(path).parents} - {"/"}):
        command += ["--perms", "0755", "--dir", parent]
    for directory in layout.directories:
        command += ["--ro-bind", directory, directory]
    for directory in layout.covered:
        command += ["--size", "4096", "--tmpfs", directory, "--remount-ro", directory]
    for path in layout.files:
        command += ["--ro-bind", path, path]
    for link, target in layout.symlinks:
        command += ["--symlink", target, link]
    command += ["--ro-bind", runner_dir(), RUNNER_DIR]
    command += ["--proc", "/proc", "--dev", "/dev",
                "--perms", "1777", "--size", str(disk_bytes), "--tmpfs", WORKDIR,
                "--symlink", TMPDIR, "/tmp",
                "--remount-ro", "/", "--remount-ro", "/dev", "--chdir", WORKDIR]
    return command


# --- seccomp ------------------------------------------------------------------------------------------

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# (x86_64, aarch64) numbers of the syscalls answered with EPERM.
_DENIED = {
    "unshare": (272, 97), "setns": (308, 268), "mount": (165, 40), "umount2": (166, 39),
    "pivot_root": (155, 41), "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430),
    "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442),
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218), "bpf": (321, 280),
    "perf_event_open": (298, 241), "userfaultfd": (323, 282), "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    # Memory that outlives its mappings escapes RLIMIT_AS: SysV shared memory stays until the IPC namespace
    # dies; a memfd holds up to max_file_mb per descriptor.
    "shmget": (29, 194), "memfd_create": (319, 279), "memfd_secret": (447, 447),
}
_CLONE = (56, 220)
_CLONE3 = (435, 435)
CLONE_NEW_FLAGS = 0x7E020080  # NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
_EPERM, _ENOSYS = 1, 38
_RET_ALLOW, _RET_ERRNO, _RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
_LD_ABS_W, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06


def seccomp_supported() -> bool:
    return platform.machine() in _AUDIT_ARCH


@lru_cache(maxsize=1)
def seccomp_program() -> bytes:
    """The filter as the raw ``struct sock_filter`` array bubblewrap's ``--seccomp FD`` reads."""
    machine = platform.machine()
    if machine not in _AUDIT_ARCH:
        raise RuntimeError(f"no seccomp filter for {machine}; known: {', '.join(_AUDIT_ARCH)}")
    column = 0 if machine == "x86_64" else 1
    program = [(_LD_ABS_W, 0, 0, 4), (_JEQ_K, 1, 0, _AUDIT_ARCH[machine]), (_RET_K, 0, 0, _RET_KILL_PROCESS),
               (_LD_ABS_W, 0, 0, 0)]
    if machine == "x86_64":  # x32 ABI numbers have bit 30 set
        program += [(_JGE_K, 0, 1, 0x40000000), (_RET_K, 0, 0, _RET_KILL_PROCESS)]
    for numbers in _DENIED.values():
        program += [(_JEQ_K, 0, 1, numbers[column]), (_RET_K, 0, 0, _RET_ERRNO | _EPERM)]
    program += [(_JEQ_K, 0, 1, _CLONE3[column]), (_RET_K, 0, 0, _RET_ERRNO | _ENOSYS),
                (_JEQ_K, 1, 0, _CLONE[column]), (_RET_K, 0, 0, _RET_ALLOW),
                (_LD_ABS_W, 0, 0, 16),  # clone's flags: the low half of args[0] (little-endian)
                (_JSET_K, 0, 1, CLONE_NEW_FLAGS), (_RET_K, 0, 0, _RET_ERRNO | _EPERM), (_RET_K, 0, 0, _RET_ALLOW)]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)
