"""Load test of the feedback service: N concurrent clients post edge cases and votes for T seconds.

The server is ``posttrain serve feedback`` in its own process on 127.0.0.1 (rate limit off), against a
fresh SQLite file and, with ``--backend both`` (default) or ``postgresql``, a throwaway local PostgreSQL
server (``posttrain.serve.pg_local``). Each client is a thread with its own ingest and annotator tokens and
its own HTTP connection, and repeats: post a new edge case (2 responses), every third time re-post one of
its earlier cases (must answer 200, ``created: false``), then fetch a task and vote on it with a reason.

Checks, after the run, against the database: no request failed; every case a client got 201 for is
stored once, no other case is stored (no lost and no duplicated row), every re-post named a stored case,
the votes stored are exactly the votes that got 201, and every case has its 2 responses. Prints ONE JSON
line: per backend the requests, errors, latency p50/p95/p99 (ms, all requests), requests/s and row counts.

    python benchmarks/feedback_load.py                        # 50 clients, 30 s, SQLite and PostgreSQL
    python benchmarks/feedback_load.py --clients 20 --duration 5 --backend sqlite    # the CI version
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))] if ordered else float("nan")


class Client(threading.Thread):
    def __init__(self, index: int, url: str, ingest: str, annotator: str, deadline: float):
        super().__init__(name=f"client-{index}", daemon=True)
        self.index, self.url, self.deadline = index, url, deadline
        self.tokens = {"ingest": ingest, "annotator": annotator}
        self.attempts = 0
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self.created: list[str] = []
        self.reposted: list[str] = []
        self.votes: list[int] = []

    def _call(self, client, method: str, path: str, role: str, expect: tuple[int, ...], **kwargs):
        self.attempts += 1
        start = time.perf_counter()
        try:
            reply = client.request(method, path, headers={"Authorization": f"Bearer {self.tokens[role]}"}, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
            self.errors.append(f"{method} {path}: {type(exc).__name__}: {exc}")
            return None
        self.latencies.append(time.perf_counter() - start)
        if reply.status_code not in expect:
            self.errors.append(f"{method} {path}: {reply.status_code} {reply.text[:200]}")
            return None
        return reply

    def run(self) -> None:
        import httpx

        rng = random.Random(self.index)
        bodies: list[dict] = []
        with httpx.Client(base_url=self.url, timeout=60) as client:
            step = 0
            while time.monotonic() < self.deadline:
                step += 1
                body = {"prompt": f"client {self.index} case {step}: what is {step} * 7?",
                        "responses": [{"text": str(step * 7 - 1), "model_id": "round-1", "sampling": {"temperature": 0.8}},
                                      {"text": str(step * 7), "model_id": "round-2", "sampling": {"temperature": 0.8}}],
                        "signal": {"type": "failed_verifier", "detail": f"expected {step * 7}"},
                        "source": "load-test", "group": "arithmetic"}  # fmt: skip
                reply = self._call(client, "POST", "/api/edge-cases", "ingest", (201,), json=body)
                if reply is not None:
                    self.created.append(reply.json()["id"])
                    bodies.append(body)
                if step % 3 == 0 and bodies:
                    reply = self._call(client, "POST", "/api/edge-cases", "ingest", (200,), json=rng.choice(bodies))
                    if reply is not None:
                        self.reposted.append(reply.json()["id"])
                task = self._call(client, "GET", "/api/tasks/next", "annotator", (200, 204))
                if task is not None and task.status_code == 200:
                    left_text = task.json()["left"]["text"]
                    choice = "left" if int(left_text) % 7 == 0 else "right"
                    vote = self._call(client, "POST", "/api/votes", "annotator", (201,), json={
                        "task_id": task.json()["task_id"], "choice": choice, "reason": "the multiple of 7 is right"})
                    if vote is not None:
                        self.votes.append(vote.json()["vote_id"])


def _wait_until_up(url: str, token: str, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}): {proc.stderr.read()[-2000:] if proc.stderr else ''}")
        try:
            if httpx.get(f"{url}/api/me", headers={"Authorization": f"Bearer {token}"}, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the server at {url} did not come up in {timeout_s:.0f} s")


def run_load(db_url: str, clients: int, duration_s: float) -> dict:
    from posttrain.serve.db import open_db

    db = open_db(db_url)
    tokens = [(db.create_user(f"ingest-{i}", "ingest"), db.create_user(f"annotator-{i}", "annotator"))
              for i in range(clients)]
    db.close()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "posttrain", "serve", "feedback", "--db", db_url, "--port", str(port), "--rate", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        _wait_until_up(url, tokens[0][0], server)
        deadline = time.monotonic() + duration_s
        workers = [Client(i, url, ingest, annotator, deadline) for i, (ingest, annotator) in enumerate(tokens)]
        started = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(duration_s + 120)
        wall = time.perf_counter() - started
    finally:
        server.terminate()
        server.wait(30)
    db = open_db(db_url)
    stored_cases = {row["id"] for row in db.query("SELECT id FROM edge_cases")}
    stored_votes = [row["id"] for row in db.query("SELECT id FROM votes")]
    responses = int(db.scalar("SELECT COUNT(*) AS n FROM responses"))
    db.close()
    created = [case for w in workers for case in w.created]
    votes = [vote for w in workers for vote in w.votes]
    latencies = [s for w in workers for s in w.latencies]
    errors = [e for w in workers for e in w.errors]
    reposted = [case for w in workers for case in w.reposted]
    return {
        "clients": clients, "duration_s": duration_s, "wall_s": round(wall, 2),
        "requests": sum(w.attempts for w in workers),
        "errors": len(errors), "first_errors": errors[:3],
        "requests_per_s": round(len(latencies) / wall, 1),
        "latency_ms": {f"p{q}": round(_percentile(latencies, q) * 1000, 2) for q in (50, 95, 99)},
        "rows": {"edge_cases": len(stored_cases), "responses": responses, "votes": len(stored_votes)},
        "acknowledged": {"edge_cases_201": len(created), "reposts_200": len(reposted), "votes_201": len(votes)},
        "lost_cases": len(set(created) - stored_cases), "unacknowledged_cases": len(stored_cases - set(created)),
        "duplicated_acks": len(created) - len(set(created)), "reposts_not_stored": len(set(reposted) - stored_cases),
        "lost_votes": len(set(votes) - set(stored_votes)), "unacknowledged_votes": len(set(stored_votes) - set(votes)),
        "responses_per_case_ok": responses == 2 * len(stored_cases),
    }  # fmt: skip


def passed(figures: dict) -> bool:
    return (figures["errors"] == 0 and figures["lost_cases"] == 0 and figures["unacknowledged_cases"] == 0
            and figures["duplicated_acks"] == 0 and figures["reposts_not_stored"] == 0 and figures["lost_votes"] == 0
            and figures["unacknowledged_votes"] == 0 and figures["responses_per_case_ok"])  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load per backend")
    parser.add_argument("--backend", choices=("sqlite", "postgresql", "both"), default="both")
    args = parser.parse_args()
    results: dict = {"benchmark": "feedback_load"}
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="feedback-load-") as tmp:
        if args.backend in ("sqlite", "both"):
            results["sqlite"] = run_load(f"sqlite:///{Path(tmp) / 'feedback.db'}", args.clients, args.duration)
        if args.backend in ("postgresql", "both"):
            from posttrain.serve.pg_local import fresh_database, local_postgres

            server = stack.enter_context(local_postgres())
            results["postgresql"] = run_load(fresh_database(server), args.clients, args.duration)
    results["ok"] = all(passed(results[b]) for b in ("sqlite", "postgresql") if b in results)
    results["machine"] = {"cpu_count": os.cpu_count(), "load_avg_1m_end": round(os.getloadavg()[0], 2),
                          "python": platform.python_version(), "platform": platform.platform()}
    print(json.dumps(results))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
