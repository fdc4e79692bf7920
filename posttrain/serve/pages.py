"""The server-rendered pages: ``/login``, ``/annotate``, ``/admin`` (Jinja2 with autoescape; no build step).

A session is a signed, HttpOnly, SameSite=Strict cookie (Starlette's ``SessionMiddleware``) holding a random
session id and a CSRF token. The id is what logs the user in: the store keeps its SHA-256 with the user and an
expiry (``sessions``), and logout deletes that row, so a copy of the cookie is worthless afterwards. The
cookie's signing secret is drawn at start or read from a 0600 file (``secret_from_file``), never kept in the
store. Every form carries the CSRF token and every form POST checks it server-side (403 when missing or
wrong); the login form gets one in a pre-session. Page requests of a logged-in user take from the same
per-user rate limit as their API calls (429 with ``Retry-After``).
Every page is sent with a Content-Security-Policy that allows only this response's own inline script and
style (a fresh nonce each time), so even a payload that escaped the escaping could not run.

Pages without a valid session answer 401 with a link to ``/login``; the wrong role gets 403.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from posttrain.serve.ratelimit import TokenBuckets

TEMPLATES = Path(__file__).parent / "templates"
CHOICE_LABELS = {"left": "A", "right": "B", "tie": "tie", "both_bad": "both bad"}
SESSION_TTL_S = 12 * 3600


def new_secret() -> str:
    return secrets.token_urlsafe(48)


def secret_from_file(path: str | Path) -> str:
    """The session secret in ``path``; created (0600, a fresh secret) when missing.

    Several server processes given the same file accept each other's cookies, and sessions survive a
    restart. A file that others may read is refused rather than used: that secret signs every session.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        fd = None
    if fd is not None:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(new_secret() + "\n")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise PermissionError(f"{path} is readable by others (mode {mode:o}): chmod 600 {path}")
    secret = path.read_text(encoding="utf-8").strip()
    if len(secret) < 32:
        raise ValueError(f"{path} holds {len(secret)} characters; a session secret needs at least 32 "
                         f"(delete the file and a fresh one is made)")  # fmt: skip
    return secret


def _environment():
    import jinja2

    return jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True)


class PageError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        self.status, self.message, self.headers = status, message, headers or {}


def _render(request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
    nonce = secrets.token_urlsafe(16)
    session = request.session
    html = request.app.state.jinja.get_template(name).render(
        nonce=nonce, csrf=session.get("csrf", ""), user=context.pop("user", None), **context)
    headers = {
        "Content-Security-Policy": f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
                                   "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-store",
        "X-Frame-Options": "DENY",
    }  # fmt: skip
    return HTMLResponse(html, status_code=status, headers=headers)


def _session_user(request: Request, *roles: str, rate_limited: bool = True) -> dict[str, Any]:
    """The logged-in user, by the session id in the cookie and its row in the store (gone after logout).

    ``rate_limited``: take one request from the user's bucket, the one their API token uses too.
    """
    service = request.app.state.service
    session_id = request.session.get("sid")
    user = service.db.session_user(session_id) if isinstance(session_id, str) else None
    if user is None:
        raise PageError(401, "Please log in with your token.")
    if roles and user["role"] not in roles:
        raise PageError(403, f"Your role ({user['role']}) cannot open this page; it needs {' or '.join(roles)}.")
    wait = service.buckets.take(user["id"]) if rate_limited else 0.0
    if wait > 0:
        raise PageError(429, f"Too many requests: the limit is {service.limits.rate:g} per second. Wait a moment "
                        "and try again.", headers={"Retry-After": TokenBuckets.retry_after_header(wait)})
    return user


def _check_csrf(request: Request, form: Any) -> None:
    expected, given = request.session.get("csrf"), form.get("csrf")
    if not expected or not isinstance(given, str) or not secrets.compare_digest(expected, given):
        raise PageError(403, "The form's security token is missing or stale: reload the page and try again.")


def _prompt_messages(prompt: Any) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def _annotate_page(request: Request, user: dict, status: int = 200, error: str | None = None,
                   task: dict | None = None, reason: str = "", choice: str | None = None) -> HTMLResponse:
    service = request.app.state.service
    if task is None:
        guideline = service.guideline()
        task = service.db.next_task(user["id"], guideline["version"] if guideline else None)
    guideline = service.db.guideline(task["guideline_version"]) if task and task["guideline_version"] else None
    return _render(request, "annotate.html", status, user=user, task=task, guideline=guideline, error=error,
                   messages=_prompt_messages(task["prompt"]) if task else [], reason=reason, choice=choice,
                   choices=CHOICE_LABELS, done=request.query_params.get("done") == "1")  # fmt: skip


def add_page_routes(app: FastAPI) -> None:
    app.state.jinja = _environment()

    @app.exception_handler(PageError)
    async def page_error(request: Request, exc: PageError) -> HTMLResponse:
        headers_extra = {"WWW-Authenticate": 'Cookie realm="posttrain feedback"'} if exc.status == 401 else {}
        response = _render(request, "message.html", exc.status, message=exc.message, login=exc.status in (401, 403))
        response.headers.update({**headers_extra, **exc.headers})
        return response

    @app.get("/login")
    def login_form(request: Request) -> HTMLResponse:
        request.session.setdefault("csrf", secrets.token_urlsafe(24))
        return _render(request, "login.html")

    @app.post("/login")
    async def login(request: Request) -> Response:
        form = await request.form()
        _check_csrf(request, form)
        token = form.get("token")
        user = request.app.state.service.db.user_for_token(token.strip() if isinstance(token, str) else "")
        if user is None:
            return _render(request, "login.html", 401, error="That token is not valid.")
        session_id = await run_in_threadpool(request.app.state.service.db.start_session, user["id"], SESSION_TTL_S)
        request.session.clear()  # a fresh id and CSRF token per login: nothing from the pre-session carries over
        request.session.update({"sid": session_id, "csrf": secrets.token_urlsafe(24)})
        return RedirectResponse("/admin" if user["role"] == "admin" else "/annotate", status_code=303)

    @app.post("/logout")
    async def logout(request: Request) -> Response:
        _session_user(request, rate_limited=False)  # logging out is always allowed
        _check_csrf(request, await request.form())
        await run_in_threadpool(request.app.state.service.db.end_session, request.session["sid"])
        request.session.clear()
        return RedirectResponse("/login", status_code=303)

    @app.get("/")
    def home(request: Request) -> Response:
        user = _session_user(request)
        return RedirectResponse("/admin" if user["role"] == "admin" else "/annotate", status_code=303)

    @app.get("/annotate")
    def annotate(request: Request) -> HTMLResponse:
        return _annotate_page(request, _session_user(request, "annotator", "admin"))

    @app.post("/annotate")
    async def vote(request: Request) -> Response:
        from posttrain.serve.app import record_vote

        user = _session_user(request, "annotator", "admin")
        form = await request.form()
        _check_csrf(request, form)
        task_id, choice, reason = (str(form.get(key) or "") for key in ("task_id", "choice", "reason"))
        service = request.app.state.service
        task = service.db.task(task_id)
        if task is None or task["annotator_id"] != user["id"]:
            raise PageError(404, "That task is not assigned to you; open the annotation page again.")
        error = None if choice in CHOICE_LABELS else "Choose A, B, tie or both bad."
        if error is None:
            try:
                await run_in_threadpool(record_vote, service, user, task_id, choice, reason)
            except HTTPException as exc:
                error = str(exc.detail)
        if error is not None:  # the same pair again, with what was typed and why it was refused
            return await run_in_threadpool(_annotate_page, request, user, 422, error, task, reason,
                                           choice if choice in CHOICE_LABELS else None)
        return RedirectResponse("/annotate?done=1", status_code=303)

    @app.get("/admin")
    def admin(request: Request) -> HTMLResponse:
        from posttrain.serve.monitor import admin_stats

        user = _session_user(request, "admin")
        stats = admin_stats(request.app.state.service.db)
        for row in stats["recent_votes"]:
            row["prompt_text"] = "\n".join(m["content"] for m in _prompt_messages(json.loads(row["prompt"])))
        return _render(request, "admin.html", user=user, stats=stats, guideline=request.app.state.service.guideline())
