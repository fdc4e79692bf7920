"""The feedback store: one thin layer over SQLite (default) and PostgreSQL, shared queries, migrations at open.

``open_db(url)`` takes ``sqlite:///PATH`` (or a bare path) or ``postgresql://user@host:port/db`` and
returns a ``FeedbackDB`` whose schema is migrated to the latest version (``posttrain.serve.schema``).
Queries are written once with ``?`` placeholders; the PostgreSQL backend rewrites them to ``%s``. That and
the DDL in the migrations are the only differences between the backends.

Connections are per thread (the web server runs handlers on a thread pool). SQLite runs in WAL mode with
a busy timeout, and write transactions take the write lock up front (``BEGIN IMMEDIATE``) so concurrent
writers queue instead of failing half-way. Idempotency relies on primary keys (``INSERT … ON CONFLICT DO
NOTHING RETURNING``), never on check-then-insert, so concurrent repeats cannot create two rows.

Tokens are random (``pt_`` + 32 url-safe bytes), shown once, and stored as their SHA-256 only; so are the
ids of page sessions (``start_session``), which logout deletes. Nothing in the store signs anything: the
session cookie's secret is kept outside it (``posttrain.serve.pages``).

A SQLite store is private to its owner: the file is created 0600 (its ``-wal`` and ``-shm`` files, which
SQLite creates later with the database file's mode, follow), a store found with group or other bits has
them removed at open, and directories posttrain creates for it are 0700. Deleted rows are overwritten
(``secure_delete``), so a removed secret does not linger in a free page.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import stat
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from posttrain.data.records import stable_id
from posttrain.serve.schema import MIGRATIONS, ROLES
from posttrain.serve.text import is_blank

DEFAULT_DB = "sqlite:///feedback.db"
CHOICES = ("left", "right", "tie", "both_bad")


class FeedbackDBError(ValueError):
    """Bad input to the store (unknown role, duplicate user, bad URL); the message says what to fix."""


def _stamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def now() -> str:
    return _stamp(datetime.now(UTC))


def canonical_json(value: Any) -> str:
    """The one JSON text a value is stored and hashed as (sorted keys, no spaces, UTF-8 kept)."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def _no_such_key(key: str) -> bool:
    """True for a lookup key no row can have: ids never hold NUL, and PostgreSQL raises on one (a 500)."""
    return "\x00" in key


def edge_case_id(prompt: Any, signal: dict, source: str, captured: dict) -> str:
    """Content hash of an edge case: its prompt, signal, source and the captured response (text, model id)."""
    return stable_id({"prompt": prompt, "signal": signal, "source": source,
                      "captured": {"text": captured["text"], "model_id": captured["model_id"]}}, "ec-")


def response_id(case_id: str, response: dict) -> str:
    return stable_id({"edge_case": case_id, "text": response["text"], "model_id": response["model_id"],
                      "sampling": response.get("sampling") or {}}, "r-")


class _Backend:
    name = ""
    integrity_errors: tuple[type[BaseException], ...] = ()

    def connect(self) -> Any:
        raise NotImplementedError

    def sql(self, text: str) -> str:
        return text

    def begin_write(self, conn: Any) -> None:
        raise NotImplementedError

    def lock_migrations(self, conn: Any) -> None:
        """Taken inside the migration transaction: two servers starting at once migrate one after the other."""

    def after_migrations(self, conn: Any) -> None:
        """Run after migrations were applied, outside their transaction."""


SIDECARS = ("", "-wal", "-shm", "-journal")


def _private_dirs(directory: Path) -> None:
    """Create ``directory`` and its missing parents 0700 (``mkdir -p`` would give the umask's usual 0755)."""
    missing = [d for d in (directory, *directory.parents) if not d.exists()]
    for path in reversed(missing):
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:  # made by someone else meanwhile: theirs, left as it is
            continue
        os.chmod(path, 0o700)  # exactly 0700 whatever the umask


def _tighten(path: str) -> None:
    """Remove group and other bits from the store's files that this user owns (stores made before 0600)."""
    for name in (path + suffix for suffix in SIDECARS):
        try:
            info = os.stat(name)
        except FileNotFoundError:
            continue
        if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) & 0o077:
            os.chmod(name, stat.S_IMODE(info.st_mode) & 0o700)


class _SQLite(_Backend):
    name = "sqlite"

    def __init__(self, path: str, busy_timeout_ms: int):
        import sqlite3

        self.path, self.busy_timeout_ms = path, busy_timeout_ms
        self.integrity_errors = (sqlite3.IntegrityError,)
        if path != ":memory:":
            _private_dirs(Path(path).parent)
            try:  # an empty file is an empty SQLite database; made here, it is 0600 from its first byte
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            except FileExistsError:
                pass
            _tighten(path)

    def connect(self) -> Any:
        import sqlite3

        conn = sqlite3.connect(self.path, timeout=self.busy_timeout_ms / 1000, isolation_level=None,
                               check_same_thread=False)
        conn.row_factory = sqlite3.Row
        conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_ms)}")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL: durable at checkpoints, safe against corruption
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute("PRAGMA secure_delete = ON")  # a deleted secret or session is zeroed, not left in a free page
        if self.path != ":memory:":
            _tighten(self.path)  # -wal/-shm of a store that was 0644 when they were made
        return conn

    def begin_write(self, conn: Any) -> None:
        conn.execute("BEGIN IMMEDIATE")

    def after_migrations(self, conn: Any) -> None:
        # Copy the migrated pages into the database file and empty the write-ahead log, whose old frames may
        # still hold what a migration deleted (version 2: the session secret). Best effort: a reader in another
        # process can hold frames back; the old secret is never used again either way.
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


class _Postgres(_Backend):
    name = "postgresql"

    def __init__(self, url: str):
        try:
            import psycopg
        except ImportError as exc:  # the serve extra brings it; say how to get it
            raise FeedbackDBError("a postgresql:// database needs psycopg: pip install 'posttrain[serve]'") from exc
        self.url = url
        self.integrity_errors = (psycopg.IntegrityError,)

    def connect(self) -> Any:
        import psycopg
        from psycopg.rows import dict_row

        return psycopg.connect(self.url, autocommit=True, row_factory=dict_row)

    def sql(self, text: str) -> str:
        return text.replace("?", "%s")

    def begin_write(self, conn: Any) -> None:
        conn.execute("BEGIN")

    def lock_migrations(self, conn: Any) -> None:
        conn.execute("SELECT pg_advisory_xact_lock(7411050)")


def _backend_for(url: str, busy_timeout_ms: int) -> _Backend:
    if url.startswith(("postgresql://", "postgres://")):
        return _Postgres(url)
    if url.startswith("sqlite:///"):
        return _SQLite(url[len("sqlite:///"):], busy_timeout_ms)
    if "://" in url:
        raise FeedbackDBError(f"unsupported database URL {url!r}: use sqlite:///PATH or postgresql://user@host:port/db")
    return _SQLite(url, busy_timeout_ms)


class FeedbackDB:
    """The store. Every method is safe to call from several threads at once."""

    def __init__(self, url: str, busy_timeout_ms: int = 30_000):
        self.url = url
        self.backend = _backend_for(url, busy_timeout_ms)
        self._local = threading.local()
        self._connections: list[Any] = []
        self._lock = threading.Lock()

    # -- plumbing -------------------------------------------------------------------------------------------

    def _conn(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self.backend.connect()
            self._local.conn = conn
            with self._lock:
                self._connections.append(conn)
        return conn

    def query(self, sql: str, params: tuple | list = ()) -> list[dict[str, Any]]:
        cursor = self._conn().execute(self.backend.sql(sql), tuple(params))
        return [dict(row) for row in cursor.fetchall()] if cursor.description else []

    def one(self, sql: str, params: tuple | list = ()) -> dict[str, Any] | None:
        rows = self.query(sql, params)
        return rows[0] if rows else None

    def scalar(self, sql: str, params: tuple | list = ()) -> Any:
        row = self.one(sql, params)
        return next(iter(row.values())) if row else None

    @contextlib.contextmanager
    def write(self) -> Iterator[FeedbackDB]:
        """A write transaction: commits on success, rolls back on any error."""
        conn = self._conn()
        self.backend.begin_write(conn)
        try:
            yield self
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            for conn in self._connections:
                with contextlib.suppress(Exception):
                    conn.close()
            self._connections.clear()
        self._local = threading.local()

    # -- migrations -----------------------------------------------------------------------------------------

    def migrate(self) -> list[int]:
        """Apply every migration not yet recorded in ``schema_migrations``; return the versions applied."""
        applied_now = []
        self.query("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, "
                   "applied_at TEXT NOT NULL)")  # fmt: skip
        with self.write():
            self.backend.lock_migrations(self._conn())
            done = {row["version"] for row in self.query("SELECT version FROM schema_migrations")}
            for migration in MIGRATIONS:
                if migration.version in done:
                    continue
                for statement in migration.sql(self.backend.name):
                    self.query(statement)
                self.query("INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)",
                           (migration.version, migration.name, now()))
                applied_now.append(migration.version)
        if applied_now:
            self.backend.after_migrations(self._conn())
        return applied_now

    def schema_version(self) -> int:
        return int(self.scalar("SELECT MAX(version) AS v FROM schema_migrations") or 0)

    # -- users and tokens -----------------------------------------------------------------------------------

    def create_user(self, name: str, role: str) -> str:
        """Create a user; return the token, which is shown once and stored only as its SHA-256."""
        if role not in ROLES:
            raise FeedbackDBError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
        if not name or is_blank(name):
            raise FeedbackDBError("a user needs a non-empty name (visible characters, not only spaces)")
        token = "pt_" + secrets.token_urlsafe(32)
        try:
            with self.write():
                self.query("INSERT INTO users (name, role, token_hash, created_at) VALUES (?, ?, ?, ?)",
                           (name, role, hash_token(token), now()))
        except self.backend.integrity_errors as exc:
            raise FeedbackDBError(f"a user named {name!r} already exists") from exc
        return token

    def user_for_token(self, token: str) -> dict[str, Any] | None:
        if not token:
            return None
        return self.one("SELECT id, name, role FROM users WHERE token_hash = ?", (hash_token(token),))

    def user(self, user_id: int) -> dict[str, Any] | None:
        return self.one("SELECT id, name, role FROM users WHERE id = ?", (user_id,))

    # -- page sessions --------------------------------------------------------------------------------------

    def start_session(self, user_id: int, ttl_s: float) -> str:
        """A new page session for ``user_id``, valid ``ttl_s`` seconds; returns its id (stored as SHA-256 only)."""
        session_id = secrets.token_urlsafe(32)
        started = datetime.now(UTC)
        with self.write():
            self.query("DELETE FROM sessions WHERE expires_at <= ?", (_stamp(started),))  # expired: of no use
            self.query("INSERT INTO sessions (id_hash, user_id, created_at, expires_at) VALUES (?, ?, ?, ?)",
                       (hash_token(session_id), user_id, _stamp(started), _stamp(started + timedelta(seconds=ttl_s))))
        return session_id

    def session_user(self, session_id: str) -> dict[str, Any] | None:
        """The user of a live (started, not ended, not expired) session, or None."""
        if not session_id:
            return None
        return self.one("SELECT u.id, u.name, u.role FROM sessions s JOIN users u ON u.id = s.user_id "
                        "WHERE s.id_hash = ? AND s.expires_at > ?", (hash_token(session_id), now()))  # fmt: skip

    def end_session(self, session_id: str) -> None:
        self.query("DELETE FROM sessions WHERE id_hash = ?", (hash_token(session_id),))

    # -- guidelines -----------------------------------------------------------------------------------------

    def put_guideline(self, version: str, text: str) -> None:
        """Store guideline ``version``; the same version with other text is an error (versions are immutable)."""
        self.query("INSERT INTO guidelines (version, text, created_at) VALUES (?, ?, ?) ON CONFLICT (version) DO NOTHING",
                   (version, text, now()))  # fmt: skip
        stored = self.scalar("SELECT text FROM guidelines WHERE version = ?", (version,))
        if stored != text:
            raise FeedbackDBError(f"guideline version {version!r} is already stored with other text; give a new version")

    def guideline(self, version: str | None) -> dict[str, Any] | None:
        if version is None:
            return self.one("SELECT version, text FROM guidelines ORDER BY created_at DESC, version DESC LIMIT 1")
        return self.one("SELECT version, text FROM guidelines WHERE version = ?", (version,))

    # -- capture --------------------------------------------------------------------------------------------

    def add_edge_case(self, case: dict[str, Any], user_id: int) -> dict[str, Any]:
        """Store an edge case (``prompt``, ``responses``, ``signal``, ``source``, ``group``, ``metadata``).

        Returns ``{"id", "created", "responses": [ids], "responses_added"}``. A repeat of a stored case
        creates nothing; responses it carries beyond the stored ones are added as alternatives.
        """
        responses = case["responses"]
        case_id = edge_case_id(case["prompt"], case["signal"], case["source"], responses[0])
        stamp = now()
        for _ in range(5):  # a concurrent alternative may take the next position: retry on the unique key
            try:
                with self.write():
                    created = self.one(
                        "INSERT INTO edge_cases (id, prompt, signal, source, metadata, group_name, created_by, created_at)"
                        " VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING RETURNING id",
                        (case_id, canonical_json(case["prompt"]), canonical_json(case["signal"]), case["source"],
                         canonical_json(case.get("metadata") or {}), case.get("group"), user_id, stamp),
                    ) is not None  # fmt: skip
                    ids, added = self._add_responses(case_id, responses, user_id, stamp)
                return {"id": case_id, "created": created, "responses": ids, "responses_added": added}
            except self.backend.integrity_errors:
                continue
        raise RuntimeError(f"could not store the responses of {case_id} after 5 tries (constant contention)")

    def add_responses(self, case_id: str, responses: list[dict[str, Any]], user_id: int) -> dict[str, Any] | None:
        """Add alternative responses to a stored case; None when the case does not exist."""
        if _no_such_key(case_id):
            return None
        for _ in range(5):
            try:
                with self.write():
                    if self.one("SELECT id FROM edge_cases WHERE id = ?", (case_id,)) is None:
                        return None
                    ids, added = self._add_responses(case_id, responses, user_id, now())
                return {"id": case_id, "responses": ids, "responses_added": added}
            except self.backend.integrity_errors:
                continue
        raise RuntimeError(f"could not add responses to {case_id} after 5 tries (constant contention)")

    def _add_responses(self, case_id: str, responses: list[dict], user_id: int, stamp: str) -> tuple[list[str], int]:
        ids, added = [], 0
        for response in responses:
            rid = response_id(case_id, response)
            ids.append(rid)
            if self.one("SELECT id FROM responses WHERE id = ?", (rid,)) is not None:
                continue
            position = self.scalar("SELECT COALESCE(MAX(position), -1) + 1 AS p FROM responses WHERE edge_case_id = ?",
                                   (case_id,))  # fmt: skip
            self.query("INSERT INTO responses (id, edge_case_id, position, text, model_id, sampling, created_by, "
                       "created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (rid, case_id, int(position), response["text"], response["model_id"],
                        canonical_json(response.get("sampling") or {}), user_id, stamp))  # fmt: skip
            added += 1
        return ids, added

    def edge_case(self, case_id: str) -> dict[str, Any] | None:
        if _no_such_key(case_id):
            return None
        row = self.one("SELECT * FROM edge_cases WHERE id = ?", (case_id,))
        if row is None:
            return None
        row["responses"] = self.query("SELECT id, position, text, model_id, sampling FROM responses "
                                      "WHERE edge_case_id = ? ORDER BY position", (case_id,))  # fmt: skip
        return row

    # -- annotation -----------------------------------------------------------------------------------------

    def next_task(self, annotator_id: int, guideline_version: str | None) -> dict[str, Any] | None:
        """The pair this annotator has not voted on with the fewest annotators so far, as an assignment
        (``next_tasks`` with a limit of one)."""
        tasks = self.next_tasks(annotator_id, guideline_version, 1)
        return tasks[0] if tasks else None

    def next_tasks(self, annotator_id: int, guideline_version: str | None, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` pairs this annotator has not voted on, fewest annotators first (ties: oldest case,
        then response position), each as an assignment: the order ``next_task`` would hand them out one by
        one, ranked by one query instead of one per pair.

        A pair is (response 0, response i ≥ 1) of one edge case. An open assignment of the same pair to the
        same annotator is reused (a reload shows the same order); otherwise left/right is drawn at random.
        """
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        pairs = self.query(
            """SELECT r0.edge_case_id AS edge_case_id, r0.id AS a, r.id AS b,
                      (SELECT COUNT(DISTINCT v.annotator_id) FROM votes v
                        WHERE v.response_a_id = r0.id AND v.response_b_id = r.id) AS n
                 FROM responses r JOIN responses r0 ON r0.edge_case_id = r.edge_case_id AND r0.position = 0
                 JOIN edge_cases e ON e.id = r.edge_case_id
                WHERE r.position >= 1 AND NOT EXISTS (SELECT 1 FROM votes v WHERE v.annotator_id = ?
                      AND v.response_a_id = r0.id AND v.response_b_id = r.id)
                ORDER BY n, e.created_at, e.id, r.position LIMIT ?""",
            (annotator_id, int(limit)),
        )
        return [self._assignment(annotator_id, guideline_version, pair) for pair in pairs]

    def _assignment(self, annotator_id: int, guideline_version: str | None, pair: dict[str, Any]) -> dict[str, Any]:
        """The annotator's open assignment of ``pair`` under this guideline version, or a new one."""
        shown = self.query("SELECT id, guideline_version FROM assignments WHERE annotator_id = ? AND response_a_id = ? "
                           "AND response_b_id = ? ORDER BY created_at DESC", (annotator_id, pair["a"], pair["b"]))
        reusable = [row["id"] for row in shown if row["guideline_version"] == guideline_version]
        if reusable:
            task = self.task(reusable[0])
        else:
            left, right = (pair["a"], pair["b"]) if secrets.randbelow(2) == 0 else (pair["b"], pair["a"])
            assignment_id = "t-" + secrets.token_urlsafe(12)
            self.query("INSERT INTO assignments (id, edge_case_id, response_a_id, response_b_id, left_response_id, "
                       "right_response_id, annotator_id, guideline_version, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, "
                       "?, ?)", (assignment_id, pair["edge_case_id"], pair["a"], pair["b"], left, right, annotator_id,
                                 guideline_version, now()))  # fmt: skip
            task = self.task(assignment_id)
        assert task is not None  # the row was just found or written
        return task

    def task(self, assignment_id: str) -> dict[str, Any] | None:
        """An assignment with the texts it shows: ``prompt`` (decoded), ``left_text``, ``right_text``."""
        if _no_such_key(assignment_id):
            return None
        row = self.one(
            """SELECT a.*, e.prompt AS prompt, l.text AS left_text, r.text AS right_text
                 FROM assignments a JOIN edge_cases e ON e.id = a.edge_case_id
                 JOIN responses l ON l.id = a.left_response_id JOIN responses r ON r.id = a.right_response_id
                WHERE a.id = ?""",
            (assignment_id,),
        )
        if row is not None:
            row["prompt"] = json.loads(row["prompt"])
        return row

    def add_vote(self, task: dict[str, Any], choice: str, reason: str, annotator_id: int) -> int:
        """Append a vote on ``task`` (an assignment row); ``choice`` is left / right / tie / both_bad as shown."""
        if choice not in CHOICES:
            raise FeedbackDBError(f"choice must be one of {', '.join(CHOICES)}")
        if not reason or is_blank(reason):
            raise FeedbackDBError("a vote needs a reason")
        winner = {"left": task["left_response_id"], "right": task["right_response_id"]}.get(choice, choice)
        with self.write():
            return int(self.scalar(
                "INSERT INTO votes (assignment_id, edge_case_id, response_a_id, response_b_id, winner, shown_left_id, "
                "reason, annotator_id, guideline_version, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
                (task["id"], task["edge_case_id"], task["response_a_id"], task["response_b_id"], winner,
                 task["left_response_id"], reason, annotator_id, task["guideline_version"], now()),
            ))  # fmt: skip

    def vote_log(self, until_id: int | None = None, until_time: str | None = None) -> list[dict[str, Any]]:
        """Every vote in order (the log export reads), optionally up to a vote id or a timestamp (inclusive)."""
        sql, params = "SELECT v.*, u.name AS annotator FROM votes v JOIN users u ON u.id = v.annotator_id", []
        if until_id is not None:
            sql, params = sql + " WHERE v.id <= ?", [until_id]
        elif until_time is not None:
            sql, params = sql + " WHERE v.created_at <= ?", [until_time]
        return self.query(sql + " ORDER BY v.id", params)


def open_db(url: str = DEFAULT_DB, busy_timeout_ms: int = 30_000) -> FeedbackDB:
    """Open the store at ``url`` (``sqlite:///PATH``, a bare path, or ``postgresql://…``) and migrate it."""
    db = FeedbackDB(url, busy_timeout_ms)
    try:
        db.migrate()
    except BaseException:
        db.close()
        raise
    return db
