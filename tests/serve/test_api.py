"""The capture and annotator API, as a client sees it, against a live server on SQLite and on PostgreSQL."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from posttrain.serve.db import hash_token, open_db
from posttrain.serve.models import Limits
from tests.serve.conftest import edge_case, start_server

# Every API route with a body that would be valid, so that only the token decides the answer.
ROUTES = [
    ("POST", "/api/edge-cases", edge_case()),
    ("POST", "/api/edge-cases/bulk", None),
    ("POST", "/api/edge-cases/ec-0/responses", {"responses": [{"text": "x", "model_id": "m"}]}),
    ("GET", "/api/edge-cases/ec-0", None),
    ("GET", "/api/tasks/next", None),
    ("POST", "/api/votes", {"task_id": "t-0", "choice": "left", "reason": "r"}),
    ("GET", "/api/tasks?limit=5", None),
    ("POST", "/api/votes/bulk", {"votes": [{"task_id": "t-0", "choice": "left", "reason": "r"}]}),
    ("GET", "/api/stats", None),
    ("GET", "/api/me", None),
    ("GET", "/annotate", None),
    ("GET", "/admin", None),
    ("GET", "/", None),
    ("POST", "/annotate", None),
    ("POST", "/logout", None),
]
ALLOWED = {"/api/edge-cases": {"ingest", "admin"}, "/api/edge-cases/bulk": {"ingest", "admin"},
           "/api/edge-cases/ec-0/responses": {"ingest", "admin"}, "/api/edge-cases/ec-0": {"ingest", "admin"},
           "/api/tasks/next": {"annotator", "admin"}, "/api/votes": {"annotator", "admin"}, "/api/stats": {"admin"},
           "/api/tasks?limit=5": {"annotator", "admin"}, "/api/votes/bulk": {"annotator", "admin"},
           "/api/me": {"annotator", "admin", "ingest"}}  # fmt: skip


def _call(client, method, path, body):
    return client.request(method, path, json=body) if body is not None else client.request(method, path)


def test_no_token_401_wrong_role_403(server):
    for method, path, body in ROUTES:
        for client in (server.client(), server.client(token="pt_not-a-real-token")):
            reply = _call(client, method, path, body)
            assert reply.status_code == 401, (method, path, reply.status_code, reply.text)
    for role in ("annotator", "ingest", "admin"):
        client = server.client(role)
        for method, path, body in ROUTES:
            if not path.startswith("/api/"):
                continue  # pages take a session, not a token: see test_pages
            reply = _call(client, method, path, body)
            if role in ALLOWED[path]:
                assert reply.status_code not in (401, 403), (role, path, reply.text)
            else:
                assert reply.status_code == 403, (role, path, reply.status_code)
    # no API documentation or schema is served anonymously either
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert server.client().get(path).status_code in (401, 404)


def test_tokens_are_stored_hashed(server):
    db = open_db(server.db_url)
    rows = db.query("SELECT * FROM users")
    db.close()
    stored = " ".join(str(value) for row in rows for value in row.values())
    assert len(rows) == 4
    for token in server.tokens.values():
        assert token not in stored
        assert hash_token(token) in stored


def test_capture_is_idempotent_by_content_hash(server):
    client = server.client("ingest")
    first = client.post("/api/edge-cases", json=edge_case())
    assert first.status_code == 201 and first.json()["created"] is True
    again = client.post("/api/edge-cases", json=edge_case())
    assert again.status_code == 200 and again.json() == {**first.json(), "created": False, "responses_added": 0}
    other = client.post("/api/edge-cases", json=edge_case(prompt="What is 6 * 8?"))
    assert other.status_code == 201 and other.json()["id"] != first.json()["id"]
    # a repeat with one more alternative adds just that one, after the stored ones
    more = client.post("/api/edge-cases", json=edge_case(texts=("41", "42", "forty-two")))
    assert more.status_code == 200 and more.json()["responses_added"] == 1
    stored = client.get(f"/api/edge-cases/{first.json()['id']}").json()
    assert [r["text"] for r in stored["responses"]] == ["41", "42", "forty-two"]
    assert [r["position"] for r in stored["responses"]] == [0, 1, 2]
    assert stored["signal"] == {"type": "thumbs_down", "detail": "wrong"}


def test_concurrent_repeats_create_one_row(server):
    body = edge_case(prompt="concurrent", texts=("a", "b", "c"))

    def post(_):
        with server.client("ingest") as client:
            return client.post("/api/edge-cases", json=body)

    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(post, range(32)))
    assert sorted(r.status_code for r in replies) == [200] * 31 + [201]
    assert len({r.json()["id"] for r in replies}) == 1
    db = open_db(server.db_url)
    assert db.scalar("SELECT COUNT(*) AS n FROM edge_cases") == 1
    assert db.scalar("SELECT COUNT(*) AS n FROM responses") == 3
    db.close()


def test_bad_bodies_are_refused_with_the_reason(server):
    client = server.client("ingest")
    unknown = client.post("/api/edge-cases", json={**edge_case(), "colour": "red"})
    assert unknown.status_code == 422 and "colour" in unknown.text
    nested = client.post("/api/edge-cases", json=edge_case(signal={"type": "thumbs_down", "extra": 1}))
    assert nested.status_code == 422
    no_response = client.post("/api/edge-cases", json={**edge_case(), "responses": []})
    assert no_response.status_code == 422


def test_size_limits_answer_413(db_url):
    live = start_server(db_url, Limits(max_body_bytes=4000, max_text_chars=500))
    try:
        client = live.client("ingest")
        long_text = client.post("/api/edge-cases", json=edge_case(texts=("x" * 501, "y")))
        assert long_text.status_code == 413
        assert "responses[0].text has 501 characters; the limit is 500" in long_text.json()["detail"]
        long_prompt = client.post("/api/edge-cases", json=edge_case(prompt="p" * 600))
        assert long_prompt.status_code == 413 and "prompt has 600 characters" in long_prompt.json()["detail"]
        big_body = client.post("/api/edge-cases", json=edge_case(metadata={"pad": "z" * 5000}))
        assert big_body.status_code == 413 and "the limit is 4000 bytes" in big_body.json()["detail"]
        # a chunked body (no Content-Length) is counted as it arrives
        chunks = iter([b'{"prompt": "', b"q" * 3000, b"q" * 3000, b'"}'])
        streamed = client.post("/api/edge-cases", content=chunks, headers={"Content-Type": "application/json"})
        assert streamed.status_code == 413
        assert client.post("/api/edge-cases", json=edge_case()).status_code == 201  # the limits leave normal use alone
    finally:
        live.stop()


def test_rate_limit_per_token_answers_429_with_retry_after(db_url):
    live = start_server(db_url, Limits(rate=0.5, burst=3))
    try:
        ingest, admin = live.client("ingest"), live.client("admin")
        codes = [ingest.get("/api/me").status_code for _ in range(5)]
        assert codes[:3] == [200, 200, 200] and codes[3:] == [429, 429]
        refused = ingest.get("/api/me")
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        assert admin.get("/api/me").status_code == 200  # another token has its own bucket
    finally:
        live.stop()


def test_annotation_flow_reason_required_and_votes_append_only(server):
    ingest, annotator = server.client("ingest"), server.client("annotator")
    case_id = ingest.post("/api/edge-cases", json=edge_case()).json()["id"]
    task = annotator.get("/api/tasks/next")
    assert task.status_code == 200
    shown = task.json()
    assert {shown["left"]["text"], shown["right"]["text"]} == {"41", "42"}
    assert "model" not in str(shown)  # model identity is hidden
    assert annotator.get("/api/tasks/next").json()["task_id"] == shown["task_id"]  # an open task is kept
    for reason in ("", "   \n\t"):
        refused = annotator.post("/api/votes", json={"task_id": shown["task_id"], "choice": "left", "reason": reason})
        assert refused.status_code == 422 and "reason is required" in refused.json()["detail"]
    missing = annotator.post("/api/votes", json={"task_id": shown["task_id"], "choice": "left"})
    assert missing.status_code == 422
    assert annotator.post("/api/votes", json={"task_id": shown["task_id"], "choice": "maybe", "reason": "x"}).status_code == 422
    # another annotator cannot vote on this annotator's task
    stolen = server.client("annotator2").post("/api/votes", json={"task_id": shown["task_id"], "choice": "left", "reason": "x"})
    assert stolen.status_code == 404
    side_of_42 = "left" if shown["left"]["text"] == "42" else "right"
    side_of_41 = "right" if side_of_42 == "left" else "left"
    first = annotator.post("/api/votes", json={"task_id": shown["task_id"], "choice": side_of_41, "reason": "first thought"})
    second = annotator.post("/api/votes", json={"task_id": shown["task_id"], "choice": side_of_42, "reason": "42 is 6*7"})
    assert first.status_code == 201 and second.status_code == 201
    assert second.json()["vote_id"] > first.json()["vote_id"]
    assert annotator.get("/api/tasks/next").status_code == 204  # the only pair has this annotator's vote

    db = open_db(server.db_url)
    votes = db.vote_log()
    assert [v["reason"] for v in votes] == ["first thought", "42 is 6*7"]  # both kept, in order
    case = db.edge_case(case_id)
    ids = {r["text"]: r["id"] for r in case["responses"]}
    assert [v["winner"] for v in votes] == [ids["41"], ids["42"]]  # left/right resolved to the true responses
    assert votes[0]["response_a_id"] == ids["41"] and votes[0]["annotator"] == "annotator"
    with pytest.raises(db.backend.integrity_errors + (Exception,), match="append-only"):
        db.query("UPDATE votes SET reason = ? WHERE id = ?", ("edited", votes[0]["id"]))
    db.close()
    db = open_db(server.db_url)
    with pytest.raises(Exception, match="append-only"):
        db.query("DELETE FROM votes")
    assert len(db.vote_log()) == 2
    db.close()


def test_next_task_prefers_the_pair_with_fewest_votes(server):
    ingest = server.client("ingest")
    ingest.post("/api/edge-cases", json=edge_case(prompt="first", texts=("a0", "a1")))
    ingest.post("/api/edge-cases", json=edge_case(prompt="second", texts=("b0", "b1")))
    one, two = server.client("annotator"), server.client("annotator2")
    task = one.get("/api/tasks/next").json()
    assert task["prompt"] == "first"
    assert one.post("/api/votes", json={"task_id": task["task_id"], "choice": "tie", "reason": "same"}).status_code == 201
    # annotator2: "first" has one vote, "second" none → "second" comes first
    assert two.get("/api/tasks/next").json()["prompt"] == "second"
    # an alternative added later is one more pair to judge
    case_id = one.get("/api/tasks/next").json()
    assert case_id["prompt"] == "second"


def test_a_batch_of_tasks_comes_in_the_order_of_next_and_bulk_votes_are_checked_one_by_one(server):
    ingest = server.client("ingest")
    for index in range(4):  # 4 cases x 2 alternatives = 8 pairs
        ingest.post("/api/edge-cases", json=edge_case(prompt=f"case {index}", texts=(f"bad {index}", "x", "y")))
    one, two = server.client("annotator"), server.client("annotator2")
    # annotator2 takes the pairs one by one: that order is what a batch must reproduce
    one_by_one = []
    while (reply := two.get("/api/tasks/next")).status_code == 200:
        task = reply.json()
        one_by_one.append((task["prompt"], {task["left"]["text"], task["right"]["text"]}))
        assert two.post("/api/votes", json={"task_id": task["task_id"], "choice": "tie", "reason": "same"}).status_code == 201
    assert len(one_by_one) == 8
    first = one.get("/api/tasks", params={"limit": 5}).json()["tasks"]
    assert [(t["prompt"], {t["left"]["text"], t["right"]["text"]}) for t in first] == one_by_one[:5]
    assert [t["task_id"] for t in one.get("/api/tasks", params={"limit": 5}).json()["tasks"]] == [
        t["task_id"] for t in first]  # open tasks are handed out again, with the same sides
    assert one.get("/api/tasks/next").json()["task_id"] == first[0]["task_id"]
    votes = [{"task_id": t["task_id"], "choice": "left", "reason": f"left is better in {t['prompt']}"} for t in first]
    votes[1]["reason"] = "  \u200b "  # invisible only: refused like POST /api/votes refuses it
    votes[3]["task_id"] = "t-not-a-task"
    stored = one.post("/api/votes/bulk", json={"votes": votes}).json()
    assert (stored["recorded"], stored["rejected"]) == (3, 2)
    assert [(r["index"], r["status"]) for r in stored["results"]] == [(0, 201), (1, 422), (2, 201), (3, 404), (4, 201)]
    assert "reason is required" in stored["results"][1]["error"]
    db = open_db(server.db_url)
    log = [v for v in db.vote_log() if v["annotator"] == "annotator"]
    db.close()
    assert [v["reason"] for v in log] == [votes[i]["reason"] for i in (0, 2, 4)]  # stored in order
    assert [r["vote_id"] for r in stored["results"] if r["status"] == 201] == [v["id"] for v in log]
    # the two refused pairs are still open, first in line; then the three never handed out
    rest = one.get("/api/tasks", params={"limit": 100}).json()["tasks"]
    assert [t["task_id"] for t in rest[:2]] == [first[1]["task_id"], first[3]["task_id"]]
    assert [(t["prompt"], {t["left"]["text"], t["right"]["text"]}) for t in rest[2:]] == one_by_one[5:]
    finish = one.post("/api/votes/bulk", json={"votes": [{"task_id": t["task_id"], "choice": "both_bad", "reason": "no"}
                                                         for t in rest]})
    assert finish.json()["recorded"] == 5
    assert one.get("/api/tasks", params={"limit": 3}).json() == {"tasks": []}
    assert one.get("/api/tasks/next").status_code == 204


def test_batch_bounds_and_a_malformed_vote_refuse_the_whole_request(server):
    server.client("ingest").post("/api/edge-cases", json=edge_case())
    annotator = server.client("annotator")
    for limit in (0, 101, "many"):
        assert annotator.get("/api/tasks", params={"limit": limit}).status_code == 422
    assert len(annotator.get("/api/tasks").json()["tasks"]) == 1  # the limit defaults to one
    task_id = annotator.get("/api/tasks").json()["tasks"][0]["task_id"]
    good = {"task_id": task_id, "choice": "left", "reason": "fine"}
    for body in ({"votes": []}, {"votes": [good] * 101}, {"votes": [good, {**good, "choice": "maybe"}]},
                 {"votes": [good], "extra": 1}):
        assert annotator.post("/api/votes/bulk", json=body).status_code == 422
    db = open_db(server.db_url)
    assert db.vote_log() == []  # nothing of a refused request was stored
    db.close()


def test_alternatives_endpoint(server):
    ingest = server.client("ingest")
    case_id = ingest.post("/api/edge-cases", json=edge_case(texts=("41",))).json()["id"]
    assert server.client("annotator").get("/api/tasks/next").status_code == 204  # one response: nothing to compare
    added = ingest.post(f"/api/edge-cases/{case_id}/responses", json={"responses": [{"text": "42", "model_id": "m2"}]})
    assert added.status_code == 201 and added.json()["responses_added"] == 1
    repeat = ingest.post(f"/api/edge-cases/{case_id}/responses", json={"responses": [{"text": "42", "model_id": "m2"}]})
    assert repeat.status_code == 200 and repeat.json()["responses_added"] == 0
    assert ingest.post("/api/edge-cases/ec-missing/responses", json={"responses": [{"text": "x", "model_id": "m"}]}).status_code == 404
    assert server.client("annotator").get("/api/tasks/next").status_code == 200


def test_bulk_jsonl_reports_each_line(server):
    import json

    lines = [json.dumps(edge_case(prompt=f"bulk {i}")) for i in range(3)]
    body = "\n".join([lines[0], lines[1], "{not json", json.dumps({"prompt": "x"}), lines[2], lines[0]]) + "\n"
    reply = server.client("ingest").post("/api/edge-cases/bulk", content=body.encode())
    assert reply.status_code == 200
    result = reply.json()
    assert (result["created"], result["existing"], result["rejected"]) == (3, 1, 2)
    assert [r["line"] for r in result["results"] if "error" in r] == [3, 4]
