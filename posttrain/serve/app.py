"""The feedback web service (FastAPI on uvicorn): the JSON API, the pages, and a server in a thread.

API (Bearer token; 401 without a valid one, 403 for the wrong role, 429 with Retry-After past the rate):

==========================================  ===================  ==========================================
``POST /api/edge-cases``                    ingest, admin        one edge case; 201 created, 200 repeat
``POST /api/edge-cases/bulk``               ingest, admin        JSONL body, one edge case a line
``POST /api/edge-cases/{id}/responses``     ingest, admin        alternative responses to compare
``GET  /api/edge-cases/{id}``               ingest, admin        the case and its responses
``GET  /api/tasks/next``                    annotator, admin     a pair to judge (204 when none left)
``POST /api/votes``                         annotator, admin     ``{task_id, choice, reason}``; 201
``GET  /api/tasks?limit=K``                 annotator, admin     up to K (≤ 100) pairs at once, in that order
``POST /api/votes/bulk``                    annotator, admin     ``{votes: [...]}``; a result per vote
``GET  /api/stats``                         admin                progress, agreement, bias (as /admin)
``GET  /api/me``                            any                  the caller's name and role
==========================================  ===================  ==========================================

Bodies larger than ``Limits.max_body_bytes`` (bulk: ``max_bulk_bytes``), texts longer than
``max_text_chars`` and JSON objects (sampling, signal detail, metadata) over ``max_json_chars`` get 413
with a message naming the limit. A body nested more than 32 levels deep, or holding a string no store can
take (a lone surrogate, NUL), gets 422; in a bulk request that is one line's result, not the request's.
The pages (``/login``, ``/annotate``, ``/admin``) are in ``posttrain.serve.pages``; they share each user's
rate limit with the API. No route answers anonymously except ``/login``.
"""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from posttrain.serve.db import FeedbackDB, FeedbackDBError, open_db
from posttrain.serve.models import (
    MAX_BATCH,
    REASON_REQUIRED,
    EdgeCaseIn,
    Limits,
    ResponsesIn,
    VoteIn,
    VotesIn,
    oversized_text,
)
from posttrain.serve.monitor import admin_stats
from posttrain.serve.ratelimit import TokenBuckets
from posttrain.serve.text import MAX_DEPTH, is_blank, text_problem

BULK_PATH = "/api/edge-cases/bulk"


@dataclass
class Service:
    db: FeedbackDB
    limits: Limits
    guideline_version: str | None = None
    secure_cookies: bool = False
    buckets: TokenBuckets = field(init=False)

    def __post_init__(self) -> None:
        self.buckets = TokenBuckets(self.limits.rate, self.limits.burst)

    def guideline(self) -> dict[str, Any] | None:
        return self.db.guideline(self.guideline_version)


class BodyLimit:
    """ASGI middleware: refuse a request body over the limit with 413, before any handler parses it."""

    def __init__(self, app: Any, limits: Limits):
        self.app, self.limits = app, limits

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limits.max_bulk_bytes if scope["path"] == BULK_PATH else self.limits.max_body_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._too_large(send, int(declared), limit)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            size += len(message.get("body", b""))
            if size > limit:
                return await self._too_large(send, size, limit)
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body, sent = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _too_large(send: Any, size: int, limit: int) -> None:
        response = JSONResponse({"detail": f"request body is {size} bytes or more; the limit is {limit} bytes"},
                                status_code=413)
        await response({"type": "http"}, None, send)


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def require(*roles: str):
    """A dependency: the calling user (by Bearer token) if their role is one of ``roles``; rate-limited."""

    def dependency(request: Request) -> dict[str, Any]:
        service: Service = request.app.state.service
        user = service.db.user_for_token(_bearer(request))
        if user is None:
            raise HTTPException(401, "a valid token is required: Authorization: Bearer TOKEN",
                                headers={"WWW-Authenticate": "Bearer"})
        if roles and user["role"] not in roles:
            raise HTTPException(403, f"role {user['role']!r} may not do this; it needs {' or '.join(roles)}")
        wait = service.buckets.take(user["id"])
        if wait > 0:
            raise HTTPException(429, f"rate limit of {service.limits.rate:g} requests/s per token exceeded",
                                headers={"Retry-After": TokenBuckets.retry_after_header(wait)})
        return user

    return dependency


INGEST = Depends(require("ingest", "admin"))
ANNOTATE = Depends(require("annotator", "admin"))
ADMIN = Depends(require("admin"))
ANYONE = Depends(require())


def _store_case(service: Service, case: EdgeCaseIn, user: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    data = case.stored()
    too_long = oversized_text(data, service.limits)
    if too_long:
        return 413, {"detail": too_long}
    result = service.db.add_edge_case(data, user["id"])
    return (201 if result["created"] else 200), result


def _task_json(service: Service, task: dict[str, Any]) -> dict[str, Any]:
    guideline = service.db.guideline(task["guideline_version"]) if task["guideline_version"] else None
    return {"task_id": task["id"], "prompt": task["prompt"], "left": {"text": task["left_text"]},
            "right": {"text": task["right_text"]}, "guideline": guideline}


def record_vote(service: Service, user: dict[str, Any], task_id: str, choice: str, reason: str) -> int:
    """Validate and append one vote (shared by the API and the annotation page); HTTPException on refusal."""
    if is_blank(reason):  # whitespace and zero-width characters alone are no reason
        raise HTTPException(422, REASON_REQUIRED)
    problem = text_problem(reason)
    if problem:
        raise HTTPException(422, f"reason {problem}")
    if len(reason) > service.limits.max_text_chars:
        raise HTTPException(413, f"reason has {len(reason)} characters; the limit is {service.limits.max_text_chars}")
    task = service.db.task(task_id)
    if task is None or task["annotator_id"] != user["id"]:
        raise HTTPException(404, f"no task {task_id!r} assigned to you; fetch one with GET /api/tasks/next")
    try:
        return service.db.add_vote(task, choice, reason.strip(), user["id"])
    except FeedbackDBError as exc:
        raise HTTPException(422, str(exc)) from None


def _add_api_routes(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes each error's input: a body with a lone surrogate then fails to encode
        # (500), and a megabyte body comes back whole. Where and why is enough to fix a request.
        return JSONResponse({"detail": [{key: error[key] for key in ("type", "loc", "msg") if key in error}
                                        for error in exc.errors()]}, status_code=422)  # fmt: skip

    @app.post("/api/edge-cases")
    def post_edge_case(case: EdgeCaseIn, request: Request, user: dict = INGEST) -> JSONResponse:
        status, body = _store_case(request.app.state.service, case, user)
        return JSONResponse(body, status_code=status)

    @app.post(BULK_PATH)
    async def post_bulk(request: Request, user: dict = INGEST) -> JSONResponse:
        from starlette.concurrency import run_in_threadpool

        body = await request.body()
        return await run_in_threadpool(_bulk, request.app.state.service, body, user)

    @app.post("/api/edge-cases/{case_id}/responses")
    def post_responses(case_id: str, body: ResponsesIn, request: Request, user: dict = INGEST) -> JSONResponse:
        service: Service = request.app.state.service
        data = body.model_dump(mode="json")
        too_long = oversized_text(data, service.limits)
        if too_long:
            return JSONResponse({"detail": too_long}, status_code=413)
        result = service.db.add_responses(case_id, data["responses"], user["id"])
        if result is None:
            raise HTTPException(404, f"no edge case {case_id!r}")
        return JSONResponse(result, status_code=201 if result["responses_added"] else 200)

    @app.get("/api/edge-cases/{case_id}")
    def get_edge_case(case_id: str, request: Request, user: dict = INGEST) -> dict:
        case = request.app.state.service.db.edge_case(case_id)
        if case is None:
            raise HTTPException(404, f"no edge case {case_id!r}")
        for key in ("prompt", "signal", "metadata"):
            case[key] = json.loads(case[key])
        for response in case["responses"]:
            response["sampling"] = json.loads(response["sampling"])
        case["group"] = case.pop("group_name")
        return case

    @app.get("/api/tasks/next")
    def next_task(request: Request, user: dict = ANNOTATE) -> Response:
        service: Service = request.app.state.service
        guideline = service.guideline()
        task = service.db.next_task(user["id"], guideline["version"] if guideline else None)
        if task is None:
            return Response(status_code=204)
        return JSONResponse(_task_json(service, task))

    @app.post("/api/votes")
    def post_vote(vote: VoteIn, request: Request, user: dict = ANNOTATE) -> JSONResponse:
        vote_id = record_vote(request.app.state.service, user, vote.task_id, vote.choice, vote.reason)
        return JSONResponse({"vote_id": vote_id}, status_code=201)

    @app.get("/api/tasks")
    def next_tasks(request: Request, limit: int = Query(default=1, ge=1, le=MAX_BATCH),
                   user: dict = ANNOTATE) -> dict:
        # For a scripted annotator (a verifier, a judge model): the pairs /api/tasks/next would give one call
        # at a time, in the same order, each assigned to the caller. An empty list when nothing is left.
        service: Service = request.app.state.service
        guideline = service.guideline()
        tasks = service.db.next_tasks(user["id"], guideline["version"] if guideline else None, limit)
        return {"tasks": [_task_json(service, task) for task in tasks]}

    @app.post("/api/votes/bulk")
    def post_votes(body: VotesIn, request: Request, user: dict = ANNOTATE) -> dict:
        # Each vote is checked and stored on its own, in order, as POST /api/votes would: a refused one is
        # reported in its result and does not stop the others (a malformed body is refused whole, 422).
        results, counts = [], {"recorded": 0, "rejected": 0}
        for index, vote in enumerate(body.votes):
            try:
                vote_id = record_vote(request.app.state.service, user, vote.task_id, vote.choice, vote.reason)
            except HTTPException as exc:
                results.append({"index": index, "status": exc.status_code, "error": exc.detail})
                counts["rejected"] += 1
            else:
                results.append({"index": index, "status": 201, "vote_id": vote_id})
                counts["recorded"] += 1
        return {**counts, "results": results}

    @app.get("/api/stats")
    def stats(request: Request, user: dict = ADMIN) -> dict:
        return admin_stats(request.app.state.service.db)

    @app.get("/api/me")
    def me(user: dict = ANYONE) -> dict:
        return {"name": user["name"], "role": user["role"]}


def _parse_line(line: bytes) -> EdgeCaseIn | str:
    """One bulk line as an edge case, or why it is refused."""
    try:
        return EdgeCaseIn.model_validate(json.loads(line))
    except RecursionError:  # deeper than Python's JSON parser goes, so far past the depth limit
        return f"the line is nested more than {MAX_DEPTH} levels deep (the limit is {MAX_DEPTH} levels)"
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first.get("loc", ())))
        return f"{where}: {first['msg']}" if where else first["msg"]
    except ValueError as exc:  # not JSON, or not UTF-8
        return str(exc)


def _bulk(service: Service, body: bytes, user: dict[str, Any]) -> JSONResponse:
    """One edge case per JSONL line; each line gets its own result, a bad line does not stop the others."""
    results, counts = [], {"created": 0, "existing": 0, "rejected": 0}
    for number, line in enumerate(body.split(b"\n"), start=1):
        if not line.strip():
            continue
        case = _parse_line(line)
        if isinstance(case, str):
            results.append({"line": number, "status": 422, "error": case})
            counts["rejected"] += 1
            continue
        status, result = _store_case(service, case, user)
        if status == 413:
            results.append({"line": number, "status": 413, "error": result["detail"]})
            counts["rejected"] += 1
        else:
            results.append({"line": number, "status": status, "id": result["id"], "created": result["created"]})
            counts["created" if result["created"] else "existing"] += 1
    return JSONResponse({**counts, "results": results})


def create_app(db: FeedbackDB | str, limits: Limits | None = None, *, guideline_version: str | None = None,
               secure_cookies: bool = False, session_secret: str | None = None) -> FastAPI:
    """The ASGI app over ``db`` (a store or its URL). ``secure_cookies``: send the session cookie over HTTPS only.

    ``session_secret`` signs the session cookie; None draws a fresh one, so a restart ends every page session
    (``posttrain serve feedback --session-secret-file`` keeps one across restarts and processes). It is never
    written to the store: whoever can read the store must not be able to sign a cookie.
    """
    from starlette.middleware.sessions import SessionMiddleware

    from posttrain.serve.pages import SESSION_TTL_S, add_page_routes, new_secret

    db = open_db(db) if isinstance(db, str) else db
    limits = limits or Limits()
    if guideline_version is not None and db.guideline(guideline_version) is None:
        raise FeedbackDBError(f"guideline version {guideline_version!r} is not stored; start with --guidelines FILE")
    app = FastAPI(title="posttrain feedback", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = Service(db, limits, guideline_version, secure_cookies)
    _add_api_routes(app)
    add_page_routes(app)
    app.add_middleware(SessionMiddleware, secret_key=session_secret or new_secret(),
                       session_cookie="posttrain_session", same_site="strict", https_only=secure_cookies,
                       max_age=SESSION_TTL_S)  # fmt: skip
    app.add_middleware(BodyLimit, limits=limits)
    return app


def run_in_thread(db_url: str, limits: Limits | None = None, *, guideline_version: str | None = None,
                  host: str = "127.0.0.1", session_secret: str | None = None) -> tuple[str, Any]:
    """Serve ``db_url`` on ``host`` at a free port in a background thread; return ``(base_url, stop)``.

    ``stop()`` shuts the server down and closes the store. Used by the tests and by the flywheel.
    """
    import uvicorn

    db = open_db(db_url)
    app = create_app(db, limits, guideline_version=guideline_version, session_secret=session_secret)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=30))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"feedback-server-{port}", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the feedback server did not start (see its log above)")
        thread.join(0.02)

    def stop() -> None:
        server.should_exit = True
        thread.join(10)
        sock.close()
        db.close()

    return f"http://{host}:{port}", stop
