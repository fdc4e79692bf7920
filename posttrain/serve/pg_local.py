"""A throwaway local PostgreSQL server for tests and benchmarks (never for real data: fsync is off).

``local_postgres()`` runs Debian's binaries (``/usr/lib/postgresql/<version>/bin``, the newest found):
``initdb`` into a temp dir, ``pg_ctl start`` on a free port listening on 127.0.0.1 only (and a Unix socket
in the temp dir), yields ``postgresql://postgres@127.0.0.1:PORT/postgres``, and stops and removes it on exit.
``initdb`` refuses to run as root, so as root the server runs as ``nobody`` in a directory it owns.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL binaries here; the message says how to install them."""


def postgres_bin() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if not found:
        raise PostgresUnavailable("PostgreSQL is not installed: `make postgresql` (apt-get install postgresql)")
    return Path(found[-1]).parent


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def local_postgres(max_connections: int = 300) -> Iterator[str]:
    bin_dir = postgres_bin()
    workdir = Path(tempfile.mkdtemp(prefix="posttrain-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(workdir, "nobody", "nogroup")
        as_user = ["runuser", "-u", "nobody", "--"]
    data, port = workdir / "data", free_port()

    def run(*args: str) -> None:
        proc = subprocess.run([*as_user, *args], capture_output=True, text=True, timeout=120, cwd=workdir)
        if proc.returncode != 0:
            log = (workdir / "log").read_text(errors="replace")[-1500:] if (workdir / "log").exists() else ""
            raise RuntimeError(f"{Path(args[0]).name} failed: {proc.stdout[-1500:]} {proc.stderr[-1500:]} {log}")

    try:
        run(str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-locale")
        options = (f"-k {workdir} -h 127.0.0.1 -p {port} -c fsync=off -c synchronous_commit=off "
                   f"-c full_page_writes=off -c max_connections={max_connections}")  # fmt: skip
        run(str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(workdir / "log"), "-w", "-t", "60", "-o", options, "start")
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                           capture_output=True, timeout=60, cwd=workdir)  # fmt: skip
        shutil.rmtree(workdir, ignore_errors=True)


def fresh_database(server_url: str) -> str:
    """A new empty database on ``server_url``'s server; returns its URL."""
    import psycopg

    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return server_url.rsplit("/", 1)[0] + "/" + name
