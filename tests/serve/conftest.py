"""Fixtures of the feedback-service tests: a real PostgreSQL server for the session, a store per test on
either backend, and a live server on 127.0.0.1 with one user per role.

PostgreSQL comes from Debian's binaries (``make test`` installs ``postgresql``), started by
``posttrain.serve.pg_local.local_postgres``: ``initdb`` into a temp dir, ``pg_ctl start`` on a free port
listening on 127.0.0.1 only, stopped at teardown (as ``nobody`` when the tests run as root).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from posttrain.serve.pg_local import PostgresUnavailable, fresh_database, local_postgres, postgres_bin

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("POSTTRAIN_TEST_ARTIFACTS") or ROOT / "artifacts")
BACKENDS = ["sqlite", "postgresql"]


@pytest.fixture(scope="session")
def postgres_server():
    """``postgresql://postgres@127.0.0.1:PORT/postgres`` of a throwaway server, stopped after the session."""
    try:
        postgres_bin()
    except PostgresUnavailable as exc:
        pytest.fail(str(exc))  # CI installs it (`make test`): a missing server is a broken set-up, not a skip
    with local_postgres() as url:
        yield url


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
