"""The service's commands as a user runs them: ``serve user add``, ``serve import`` (JSONL and eval results),
and the import weight of ``--help`` (no web framework, no database driver; training never imports serve)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

from posttrain.cli import main
from posttrain.eval.harness import evaluate
from posttrain.serve.db import open_db
from tests.serve.conftest import edge_case


def test_user_add_prints_the_token_once(make_db_url, capsys):
    url = make_db_url("sqlite")
    assert main(["serve", "user", "add", "alice", "--role", "annotator", "--db", url]) == 0
    captured = capsys.readouterr()
    token = captured.out.strip()
    assert token.startswith("pt_") and "shown once" in captured.err
    db = open_db(url)
    assert db.user_for_token(token) == {"id": 1, "name": "alice", "role": "annotator"}
    db.close()
    assert main(["serve", "user", "add", "alice", "--role", "admin", "--db", url]) == 2
    assert "already exists" in capsys.readouterr().err


def test_import_jsonl_and_eval_results(server, tmp_path, capsys):
    jsonl = tmp_path / "cases.jsonl"
    lines = [json.dumps(edge_case(prompt=f"q{i}")) for i in range(3)] + ['{"prompt": 1}']
    jsonl.write_text("\n".join(lines) + "\n")
    argv = ["serve", "import", "--server", server.url, "--token", server.tokens["ingest"]]
    assert main([*argv, "--jsonl", str(jsonl)]) == 2  # one line was refused: said, and the exit code says so
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1]) == {"created": 3, "existing": 0, "rejected": 1}
    assert "line 4:" in captured.err

    suite = tmp_path / "suite.jsonl"
    items = [{"id": "add", "prompt": "2+2?", "verifier": "numeric", "answer": "4", "group": "arith", "tier": 1},
             {"id": "mul", "prompt": "6*7?", "verifier": "numeric", "answer": "42", "group": "arith", "tier": 2},
             {"id": "cap", "prompt": "Capital of France?", "verifier": "contains", "answer": "Paris", "group": "facts"}]
    suite.write_text("\n".join(json.dumps(item) for item in items) + "\n")
    results = evaluate({"add": "4", "mul": "41", "cap": "Lyon"}, str(suite), n_boot=10, progress=False,
                       model_name="tiny-sft")
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    assert main([*argv, "--eval-results", str(path)]) == 0
    assert json.loads(capsys.readouterr().out.strip()) == {"created": 2, "existing": 0, "rejected": 0}
    assert main([*argv, "--eval-results", str(path)]) == 0  # a repeat is idempotent
    assert json.loads(capsys.readouterr().out.strip()) == {"created": 0, "existing": 2, "rejected": 0}

    db = open_db(server.db_url)
    rows = db.query("SELECT * FROM edge_cases WHERE source = ? ORDER BY group_name", ("eval:suite",))
    assert [(r["group_name"], json.loads(r["prompt"])) for r in rows] == [("arith", "6*7?"), ("facts", "Capital of France?")]
    meta = json.loads(rows[0]["metadata"])
    assert (meta["eval_item_id"], meta["tier"], meta["answer"]) == ("mul", 2, "42")
    assert json.loads(rows[0]["signal"])["type"] == "failed_verifier"
    response = db.edge_case(rows[0]["id"])["responses"][0]
    assert (response["text"], response["model_id"]) == ("41", "tiny-sft")
    db.close()


def test_help_imports_no_web_framework_and_training_never_imports_serve():
    probe = """
import contextlib, io, sys
from posttrain.cli import main
for argv in (["--help"], ["serve", "--help"], ["serve", "feedback", "--help"], ["serve", "user", "add", "--help"],
             ["serve", "import", "--help"], ["feedback", "export", "--help"], ["feedback", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except SystemExit:
            pass
loaded = sorted(m for m in ("fastapi", "starlette", "uvicorn", "jinja2", "psycopg", "httpx", "posttrain.serve.app",
                            "posttrain.serve.db") if m in sys.modules)
import posttrain.train.loop, posttrain.curate.feedback, posttrain.eval.harness  # noqa: E401
serve = sorted(m for m in sys.modules if m.startswith("posttrain.serve") and m != "posttrain.serve.cli"
               and m != "posttrain.serve")
print(loaded, serve)
"""
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[] []"


def test_serve_feedback_command_starts_with_guidelines(make_db_url, tmp_path):
    import httpx

    url = make_db_url("sqlite")
    db = open_db(url)
    ingest, annotator = db.create_user("ingest", "ingest"), db.create_user("ann", "annotator")
    db.close()
    guidelines = tmp_path / "guidelines.md"
    guidelines.write_text("Prefer the correct answer; say which number is right.\n")
    assert main(["serve", "feedback", "--db", url, "--guidelines", str(guidelines)]) == 2  # needs a version too
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "posttrain", "serve", "feedback", "--db", url, "--port", str(port),
                             "--guidelines", str(guidelines), "--guidelines-version", "v7"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{base}/api/me", headers={"Authorization": f"Bearer {ingest}"}).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.1)
        assert httpx.post(f"{base}/api/edge-cases", json=edge_case(),
                          headers={"Authorization": f"Bearer {ingest}"}).status_code == 201  # fmt: skip
        task = httpx.get(f"{base}/api/tasks/next", headers={"Authorization": f"Bearer {annotator}"}).json()
        assert task["guideline"] == {"version": "v7", "text": "Prefer the correct answer; say which number is right.\n"}
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert f"feedback service on http://127.0.0.1:{port}" in out
