"""Fixtures of the feedback-service tests: a real PostgreSQL server for the session, a store per test on
either backend, and a live server on 127.0.0.1 with one user per role.

PostgreSQL comes from Debian's binaries (``make test`` installs ``postgresql``): ``initdb`` into a temp dir,
``pg_ctl start`` on a free port listening on 127.0.0.1 only, stopped at teardown. ``initdb`` refuses to
run as root, so as root the server runs as ``nobody`` in a directory it owns.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("POSTTRAIN_TEST_ARTIFACTS") or ROOT / "artifacts")
BACKENDS = ["sqlite", "postgresql"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pg_bin() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if not found:
        pytest.fail("PostgreSQL is not installed: `make test` installs it (apt-get install postgresql)")
    return Path(found[-1]).parent


@pytest.fixture(scope="session")
def postgres_server():
    """``postgresql://postgres@127.0.0.1:PORT/postgres`` of a throwaway server, stopped after the session."""
    bin_dir = _pg_bin()
    workdir = Path(tempfile.mkdtemp(prefix="posttrain-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(workdir, "nobody", "nogroup")
        as_user = ["runuser", "-u", "nobody", "--"]
    data, port = workdir / "data", _free_port()

    def run(*args: str, timeout: int = 120) -> None:
        proc = subprocess.run([*as_user, *args], capture_output=True, text=True, timeout=timeout, cwd=workdir)
        assert proc.returncode == 0, f"{args[0]} failed: {proc.stdout[-1500:]} {proc.stderr[-1500:]}"

    run(str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-locale")
    options = f"-k {workdir} -h 127.0.0.1 -p {port} -c fsync=off -c synchronous_commit=off -c max_connections=300"
    run(str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(workdir / "log"), "-w", "-t", "60", "-o", options, "start")
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                       capture_output=True, timeout=60, cwd=workdir)  # fmt: skip
        shutil.rmtree(workdir, ignore_errors=True)


def fresh_database(server_url: str) -> str:
    """A new empty database on the session's server (one per test: tests never see each other's rows)."""
    import psycopg

    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return server_url.rsplit("/", 1)[0] + "/" + name


@pytest.fixture
def make_db_url(request, tmp_path):
    """``make_db_url(backend)`` → the URL of a fresh, empty store on that backend."""

    def make(backend: str) -> str:
        if backend == "sqlite":
            return f"sqlite:///{tmp_path / f'feedback-{uuid.uuid4().hex[:6]}.db'}"
        return fresh_database(request.getfixturevalue("postgres_server"))

    return make


@pytest.fixture(params=BACKENDS)
def db_url(request, make_db_url) -> str:
    return make_db_url(request.param)


@dataclass
class LiveServer:
    url: str
    db_url: str
    tokens: dict[str, str]
    stop: object = field(repr=False)

    def client(self, role: str | None = None, token: str | None = None):
        import httpx

        token = token or (self.tokens[role] if role else None)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)


def start_server(db_url: str, limits=None, guideline: tuple[str, str] | None = None) -> LiveServer:
    from posttrain.serve.app import run_in_thread
    from posttrain.serve.db import open_db

    db = open_db(db_url)
    tokens = {name: db.create_user(name, role) for name, role in
              (("admin", "admin"), ("annotator", "annotator"), ("annotator2", "annotator"), ("ingest", "ingest"))}
    if guideline:
        db.put_guideline(*guideline)
    db.close()
    url, stop = run_in_thread(db_url, limits, guideline_version=guideline[0] if guideline else None)
    return LiveServer(url, db_url, tokens, stop)


@pytest.fixture
def server(db_url):
    live = start_server(db_url)
    yield live
    live.stop()


def edge_case(prompt="What is 6 * 7?", texts=("41", "42"), **extra) -> dict:
    """A capture body: response 0 is the captured (bad) one, the rest are alternatives."""
    return {"prompt": prompt, "responses": [{"text": t, "model_id": f"model-{i}", "sampling": {"temperature": 0.7}}
                                            for i, t in enumerate(texts)],
            "signal": {"type": "thumbs_down", "detail": "wrong"}, "source": "test", **extra}  # fmt: skip
