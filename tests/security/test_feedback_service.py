"""Regression tests for the feedback service's security review (posttrain/serve, docs/feedback.md).

Each test drives a live server (or the store) the way an attacker or a careless client would: the store's
files and the session secret, blank-looking reasons, replaying a cookie after logout, oversized signal
details and sampling settings, deeply nested or unencodable JSON in a bulk import, and page votes past
the rate limit. The PostgreSQL cases run against a throwaway local server (``tests/serve/conftest.py``).
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import stat

import httpx
import pytest

from posttrain.serve.db import open_db
from posttrain.serve.models import Limits
from posttrain.serve.schema import MIGRATIONS
from tests.serve import conftest as serve_fixtures
from tests.serve.conftest import BACKENDS, edge_case, start_server

# tests/serve's fixtures, made visible here: a throwaway PostgreSQL server, a fresh store on either backend.
postgres_server, make_db_url, db_url = serve_fixtures.postgres_server, serve_fixtures.make_db_url, serve_fixtures.db_url

LEGACY_SECRET = "legacy-secret-" + "S" * 50  # what schema v1 kept in ``settings``: anyone reading the db had it


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _csrf(html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


def _login(live, role: str) -> httpx.Client:
    client = httpx.Client(base_url=live.url, timeout=30)
    reply = client.post("/login", data={"token": live.tokens[role], "csrf": _csrf(client.get("/login").text)})
    assert reply.status_code == 303, reply.text
    return client


@pytest.fixture
def live(db_url):
    server = start_server(db_url)
    yield server
    server.stop()


@pytest.fixture
def umask_022():
    """The usual umask, so that "0644 by default" is what the old code would really have produced."""
    old = os.umask(0o022)
    yield
    os.umask(old)


# -- 1. the store's files, and the session secret -------------------------------------------------------------


def test_sqlite_store_files_and_the_directory_it_creates_are_private(tmp_path, umask_022):
    parent = tmp_path / "runs" / "fb"  # neither level exists: posttrain creates both
    url = f"sqlite:///{parent / 'fb.db'}"
    live = start_server(url)
    try:
        client = _login(live, "annotator")  # a write while the server holds the store open: -wal and -shm exist
        live.client("ingest").post("/api/edge-cases", json=edge_case())
        assert client.get("/annotate").status_code == 200
        files = [parent / name for name in ("fb.db", "fb.db-wal", "fb.db-shm")]
        assert all(path.exists() for path in files)
        assert {path.name: oct(_mode(path)) for path in files} == {path.name: "0o600" for path in files}
        assert oct(_mode(parent)) == "0o700" and oct(_mode(parent.parent)) == "0o700"
    finally:
        live.stop()


def test_an_existing_world_readable_sqlite_store_is_tightened_at_open(tmp_path, umask_022):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    path = shared / "fb.db"
    sqlite3.connect(path).close()
    os.chmod(path, 0o644)
    open_db(f"sqlite:///{path}").close()
    assert oct(_mode(path)) == "0o600"
    assert oct(_mode(shared)) == "0o755"  # a directory posttrain did not create is left as it was


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_session_secret_is_not_kept_in_the_store(backend, make_db_url):
    live = start_server(make_db_url(backend))
    try:
        assert _login(live, "admin").get("/admin").status_code == 200  # sessions work without it
        db = open_db(live.db_url)
        rows = db.query("SELECT key FROM settings")
        db.close()
        assert "session_secret" not in {row["key"] for row in rows}
    finally:
        live.stop()


def _legacy_store(backend: str, url: str) -> None:
    """A store as schema v1 left it: migrated to version 1 only, the session secret in ``settings``."""
    statements = [*MIGRATIONS[0].sql(backend),
                  "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at TEXT NOT NULL)",
                  "INSERT INTO schema_migrations VALUES (1, 'v1', '2025-01-01T00:00:00.000000Z')",
                  f"INSERT INTO settings (key, value) VALUES ('session_secret', '{LEGACY_SECRET}')"]  # fmt: skip
    if backend == "sqlite":
        conn = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        conn.execute("PRAGMA journal_mode = WAL")
        for statement in statements:
            conn.execute(statement)
        conn.close()
        os.chmod(url.removeprefix("sqlite:///"), 0o644)
    else:
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement)


@pytest.mark.parametrize("backend", BACKENDS)
def test_opening_a_store_that_holds_the_secret_removes_it(backend, make_db_url, umask_022):
    url = make_db_url(backend)
    _legacy_store(backend, url)
    db = open_db(url)
    try:
        assert db.query("SELECT * FROM settings WHERE key = 'session_secret'") == []
        if backend == "sqlite":  # nor left in the file's free space or the write-ahead log, while the store is open
            path = url.removeprefix("sqlite:///")
            for name in (path, path + "-wal"):
                if os.path.exists(name):
                    with open(name, "rb") as handle:
                        assert LEGACY_SECRET.encode() not in handle.read(), name
            assert oct(_mode(path)) == "0o600"
    finally:
        db.close()


# -- 2. blank-looking texts -----------------------------------------------------------------------------------

INVISIBLE = ["\u200b", "\u200b\u200c\u200d", "\ufeff", "\u2060\u2061", "\u180e", "\u00ad", " \u200b\t\u3000"]


def test_a_reason_of_invisible_characters_is_refused(live):
    live.client("ingest").post("/api/edge-cases", json=edge_case())
    annotator = live.client("annotator")
    task_id = annotator.get("/api/tasks/next").json()["task_id"]
    for reason in INVISIBLE:
        reply = annotator.post("/api/votes", json={"task_id": task_id, "choice": "left", "reason": reason})
        assert reply.status_code == 422 and "reason is required" in reply.text, (repr(reason), reply.text)
    page = _login(live, "annotator")
    html = page.get("/annotate").text
    reply = page.post("/annotate", data={"task_id": task_id, "choice": "tie", "reason": "\u200b", "csrf": _csrf(html)})
    assert reply.status_code == 422 and "reason is required" in reply.text
    assert annotator.post("/api/votes", json={"task_id": task_id, "choice": "left",
                                              "reason": "\u200bvisible"}).status_code == 201  # fmt: skip
    db = open_db(live.db_url)
    assert [vote["reason"] for vote in db.vote_log()] == ["\u200bvisible"]
    db.close()


def test_other_required_texts_refuse_invisible_characters(live):
    ingest = live.client("ingest")
    for body in (edge_case(texts=("\u200b", "42")), edge_case(source="\u2060"),
                 {**edge_case(), "responses": [{"text": "41", "model_id": "\ufeff"}]}):
        reply = ingest.post("/api/edge-cases", json=body)
        assert reply.status_code == 422, (body, reply.text)
    db = open_db(live.db_url)
    try:
        with pytest.raises(ValueError, match="non-empty name"):
            db.create_user("\u200b\u200b", "annotator")
        assert db.scalar("SELECT COUNT(*) AS n FROM edge_cases") == 0
    finally:
        db.close()


# -- 3. logout ends the session on the server ----------------------------------------------------------------


def test_a_cookie_replayed_after_logout_is_refused(live):
    live.client("ingest").post("/api/edge-cases", json=edge_case())
    client = _login(live, "annotator")
    html = client.get("/annotate").text
    cookie, csrf = client.cookies["posttrain_session"], _csrf(html)
    task_id = re.search(r'name="task_id" value="([^"]+)"', html).group(1)
    assert client.post("/logout", data={"csrf": csrf}).status_code == 303
    replay = httpx.Client(base_url=live.url, cookies={"posttrain_session": cookie}, timeout=30)
    assert replay.get("/annotate").status_code == 401
    vote = replay.post("/annotate", data={"task_id": task_id, "choice": "left", "reason": "replayed", "csrf": csrf})
    assert vote.status_code == 401
    db = open_db(live.db_url)
    assert db.vote_log() == []
    db.close()
    assert _login(live, "annotator").get("/annotate").status_code == 200  # logging in again works


# -- 4. every stored text has a limit -------------------------------------------------------------------------


def test_signal_detail_and_sampling_are_limited(make_db_url):
    live = start_server(make_db_url("sqlite"), Limits(max_text_chars=500))
    try:
        ingest = live.client("ingest")
        detail = ingest.post("/api/edge-cases", json=edge_case(signal={"type": "thumbs_down", "detail": "d" * 501}))
        assert detail.status_code == 413 and "signal.detail has 501 characters" in detail.json()["detail"]
        as_object = ingest.post("/api/edge-cases", json=edge_case(signal={"type": "x", "detail": {"k": "d" * 40_000}}))
        assert as_object.status_code == 413 and "signal.detail" in as_object.json()["detail"]
        sampling = {**edge_case(), "responses": [{"text": "41", "model_id": "m", "sampling": {"stop": ["s" * 40_000]}}]}
        reply = ingest.post("/api/edge-cases", json=sampling)
        assert reply.status_code == 413 and "responses[0].sampling" in reply.json()["detail"]
        case_id = ingest.post("/api/edge-cases", json=edge_case()).json()["id"]
        alternative = ingest.post(f"/api/edge-cases/{case_id}/responses",
                                  json={"responses": [{"text": "x", "model_id": "m", "sampling": {"p": "s" * 40_000}}]})
        assert alternative.status_code == 413
    finally:
        live.stop()


def test_a_huge_signal_detail_in_a_bulk_import_is_refused_with_the_default_limits(live):
    lines = [json.dumps(edge_case(prompt="big", signal={"type": "thumbs_down", "detail": "d" * 200_001})),
             json.dumps(edge_case(prompt="fine"))]
    reply = live.client("ingest").post("/api/edge-cases/bulk", content="\n".join(lines).encode())
    assert reply.status_code == 200
    body = reply.json()
    assert (body["created"], body["rejected"]) == (1, 1)
    assert body["results"][0]["status"] == 413 and "signal.detail" in body["results"][0]["error"]
    db = open_db(live.db_url)
    assert db.scalar("SELECT MAX(LENGTH(signal)) AS n FROM edge_cases") < 1000
    db.close()


# -- 5. deep nesting and unencodable text lose one line, not the request --------------------------------------


def _nested(depth: int) -> dict:
    value: dict = {"leaf": 1}
    for _ in range(depth):
        value = {"k": value}
    return value


def test_bulk_refuses_deep_or_unencodable_lines_and_keeps_the_others(live):
    good = [json.dumps(edge_case(prompt=f"good {i}")) for i in range(2)]
    lines = [good[0],
             json.dumps(edge_case(metadata=_nested(400))),
             json.dumps(edge_case(prompt="lone \ud800 surrogate")),  # json.dumps writes it as \ud800
             json.dumps(edge_case(metadata={"\udfff": 1})),
             '{"metadata": ' + "[" * 5000 + "]" * 5000 + "}",  # deeper than the JSON parser's recursion
             json.dumps(edge_case(texts=("nul \u0000 inside", "42"))),  # PostgreSQL text cannot hold NUL
             good[1]]  # fmt: skip
    reply = live.client("ingest").post("/api/edge-cases/bulk", content="\n".join(lines).encode())
    assert reply.status_code == 200, reply.text[:500]
    body = reply.json()
    assert (body["created"], body["rejected"]) == (2, 5)
    errors = {r["line"]: r["error"] for r in body["results"] if "error" in r}
    assert sorted(errors) == [2, 3, 4, 5, 6] and all(r["status"] == 422 for r in body["results"] if "error" in r)
    assert "32 levels" in errors[2] and "32 levels" in errors[5]
    assert "surrogate" in errors[3] and "surrogate" in errors[4]
    assert "NUL" in errors[6]


def test_single_requests_with_deep_or_unencodable_json_get_422(live):
    ingest = live.client("ingest")
    for raw in (json.dumps(edge_case(metadata=_nested(400))), json.dumps(edge_case(prompt="\ud800"))):
        reply = ingest.post("/api/edge-cases", content=raw.encode(), headers={"Content-Type": "application/json"})
        assert reply.status_code == 422, reply.text[:300]
    ingest.post("/api/edge-cases", json=edge_case())
    annotator = live.client("annotator")
    task_id = annotator.get("/api/tasks/next").json()["task_id"]
    vote = json.dumps({"task_id": task_id, "choice": "left", "reason": "bad \ud800"})
    reply = annotator.post("/api/votes", content=vote.encode(), headers={"Content-Type": "application/json"})
    assert reply.status_code == 422
    assert ingest.get("/api/me").status_code == 200  # the server is still fine


def test_a_nul_in_an_id_or_a_page_reason_is_refused_not_a_server_error(live):
    ingest = live.client("ingest")
    assert ingest.get("/api/edge-cases/ec-%00x").status_code == 404  # PostgreSQL raised on the NUL: 500
    assert ingest.post("/api/edge-cases/ec-%00x/responses",
                       json={"responses": [{"text": "x", "model_id": "m"}]}).status_code == 404  # fmt: skip
    ingest.post("/api/edge-cases", json=edge_case())
    page = _login(live, "annotator")
    html = page.get("/annotate").text
    task_id = re.search(r'name="task_id" value="([^"]+)"', html).group(1)
    vote = {"task_id": task_id, "choice": "tie", "reason": "nul \x00 inside", "csrf": _csrf(html)}
    refused = page.post("/annotate", data=vote)
    assert refused.status_code == 422 and "NUL" in refused.text
    assert page.post("/annotate", data={**vote, "task_id": "t-\x00"}).status_code == 404
    assert page.post("/annotate", data={**vote, "reason": "fine"}).status_code == 303


# -- 6. page votes share the API's rate limit ----------------------------------------------------------------


def test_votes_through_the_page_are_rate_limited(make_db_url):
    live = start_server(make_db_url("sqlite"), Limits(rate=0.01, burst=4))  # ~no refill during the test
    try:
        live.client("ingest").post("/api/edge-cases", json=edge_case())
        client = _login(live, "annotator")
        html = client.get("/annotate").text
        vote = {"task_id": re.search(r'name="task_id" value="([^"]+)"', html).group(1), "choice": "tie",
                "reason": "same", "csrf": _csrf(html)}  # fmt: skip
        codes = [client.post("/annotate", data=vote).status_code for _ in range(6)]
        assert 429 in codes, codes
        assert codes.count(303) <= 4 and codes[-1] == 429
        refused = client.post("/annotate", data=vote)
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        assert live.client("annotator").get("/api/me").status_code == 429  # one budget per user, page or API
        db = open_db(live.db_url)
        assert len(db.vote_log()) == codes.count(303)
        db.close()
    finally:
        live.stop()
