"""The pages as a browser-less client sees them: login, sessions, CSRF, roles, escaping of user content."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.serve.conftest import edge_case, start_server

PAYLOAD = '<script>alert("xss")</script><img src=x onerror=alert(1)>'


def _csrf(html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


def login(server, role: str) -> httpx.Client:
    client = httpx.Client(base_url=server.url, timeout=30)
    page = client.get("/login")
    assert page.status_code == 200
    reply = client.post("/login", data={"token": server.tokens[role], "csrf": _csrf(page.text)})
    assert reply.status_code == 303, reply.text
    return client


@pytest.fixture
def sqlite_server(make_db_url):
    live = start_server(make_db_url("sqlite"), guideline=("v1", f"Prefer correct answers. {PAYLOAD}"))
    yield live
    live.stop()


def test_pages_need_a_session_and_the_right_role(sqlite_server):
    anonymous = httpx.Client(base_url=sqlite_server.url)
    for path in ("/", "/annotate", "/admin"):
        reply = anonymous.get(path)
        assert reply.status_code == 401 and 'href="/login"' in reply.text
    # a bearer token is not a session: the pages ignore it
    bearer = sqlite_server.client("admin")
    assert bearer.get("/admin").status_code == 401
    annotator = login(sqlite_server, "annotator")
    assert annotator.get("/annotate").status_code == 200
    assert annotator.get("/admin").status_code == 403
    ingest = login(sqlite_server, "ingest")
    assert ingest.get("/annotate").status_code == 403
    assert login(sqlite_server, "admin").get("/admin").status_code == 200


def test_session_cookie_is_signed_httponly_strict(sqlite_server):
    client = httpx.Client(base_url=sqlite_server.url)
    page = client.get("/login")
    reply = client.post("/login", data={"token": sqlite_server.tokens["annotator"], "csrf": _csrf(page.text)})
    cookie = reply.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie
    assert sqlite_server.tokens["annotator"] not in reply.headers["set-cookie"]
    # a tampered cookie is no session
    value = client.cookies["posttrain_session"]
    forged = httpx.Client(base_url=sqlite_server.url, cookies={"posttrain_session": value[:-3] + "AAA"})
    assert forged.get("/annotate").status_code == 401
    bad_login = client.post("/login", data={"token": "pt_wrong", "csrf": _csrf(client.get("/login").text)})
    assert bad_login.status_code == 401 and "not valid" in bad_login.text


def test_every_form_post_checks_the_csrf_token(sqlite_server):
    sqlite_server.client("ingest").post("/api/edge-cases", json=edge_case())
    # login without / with a wrong token
    fresh = httpx.Client(base_url=sqlite_server.url)
    fresh.get("/login")
    assert fresh.post("/login", data={"token": sqlite_server.tokens["admin"]}).status_code == 403
    assert fresh.post("/login", data={"token": sqlite_server.tokens["admin"], "csrf": "forged"}).status_code == 403
    client = login(sqlite_server, "annotator")
    page = client.get("/annotate").text
    task_id = re.search(r'name="task_id" value="([^"]+)"', page).group(1)
    vote = {"task_id": task_id, "choice": "left", "reason": "because"}
    assert client.post("/annotate", data=vote).status_code == 403
    assert client.post("/annotate", data={**vote, "csrf": "forged"}).status_code == 403
    assert client.post("/logout", data={}).status_code == 403
    assert client.get("/annotate").status_code == 200  # still logged in: the forged logout did nothing
    # the session's token works, and a reason-less vote is refused by the server with the reason shown
    refused = client.post("/annotate", data={**vote, "reason": "  ", "csrf": _csrf(page)})
    assert refused.status_code == 422 and "reason is required" in refused.text
    assert client.post("/annotate", data={**vote, "csrf": _csrf(page)}).status_code == 303
    assert client.post("/logout", data={"csrf": _csrf(page)}).status_code == 303
    assert client.get("/annotate").status_code == 401


def test_user_content_renders_inert_on_annotate_and_admin(sqlite_server):
    sqlite_server.client("ingest").post("/api/edge-cases", json=edge_case(prompt=f"Q {PAYLOAD}",
                                                                     texts=(f"A {PAYLOAD}", f"B {PAYLOAD}")))
    annotator = login(sqlite_server, "annotator")
    page = annotator.get("/annotate")
    assert page.text.count("&lt;script&gt;alert(&#34;xss&#34;)&lt;/script&gt;") == 4  # prompt, A, B, guideline
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'nonce-" in csp
    task_id = re.search(r'name="task_id" value="([^"]+)"', page.text).group(1)
    assert annotator.post("/annotate", data={"task_id": task_id, "choice": "tie", "reason": f"R {PAYLOAD}",
                                             "csrf": _csrf(page.text)}).status_code == 303
    admin = login(sqlite_server, "admin").get("/admin")
    for html in (page.text, admin.text):
        assert "<script>alert" not in html and "<img src=x" not in html
        # the only scripts are the page's own, carrying this response's nonce
        nonce = re.search(r"'nonce-([^']+)'", csp if html is page.text else admin.headers["content-security-policy"]).group(1)
        for tag in re.findall(r"<script[^>]*>", html):
            assert f'nonce="{nonce}"' in tag
    assert "R &lt;script&gt;" in admin.text  # the reason is shown, escaped


def test_sessions_survive_a_restart_only_with_the_secret_file(make_db_url, tmp_path):
    import os
    import stat

    from posttrain.serve.app import run_in_thread
    from posttrain.serve.pages import secret_from_file
    from tests.serve.conftest import LiveServer

    setup = start_server(make_db_url("sqlite"))  # the users; then the same store served three times
    setup.stop()

    def serve(secret):
        url, stop = run_in_thread(setup.db_url, session_secret=secret)
        return LiveServer(url, setup.db_url, setup.tokens, stop)

    secret_file = tmp_path / "session.secret"
    first = serve(secret_from_file(secret_file))
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600 and len(secret_file.read_text().strip()) >= 32
    cookie = login(first, "annotator").cookies["posttrain_session"]
    first.stop()
    for secret, expected in ((secret_from_file(secret_file), 200), (None, 401)):  # the file's secret, a drawn one
        again = serve(secret)
        try:
            replay = httpx.Client(base_url=again.url, cookies={"posttrain_session": cookie})
            assert replay.get("/annotate").status_code == expected
        finally:
            again.stop()
    os.chmod(secret_file, 0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        secret_from_file(secret_file)
