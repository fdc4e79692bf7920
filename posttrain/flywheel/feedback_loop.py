"""How a round's failures become the next round's data, through the feedback service (``posttrain.serve``).

1. **capture**: the previous round's final model answers a *dev* suite (train-split problems it meets
   in use; never the held-out eval suite, so the score that judges the round stays clean). Each
   failure is POSTed to the service as an edge case (prompt, the failing answer with its model id and
   sampling settings, signal ``failed_verifier`` with the verifier's detail). Then the same model
   samples ``feedback.samples`` alternatives per failure, POSTed as further responses; with
   ``feedback.reference_answers``, a failure none of whose alternatives passes also gets the answer an
   annotator would write in — the dev item's reference answer, model id ``annotator-reference``.
2. **annotate**: a scripted annotator — the verifier, holding each dev item's answer key — asks the
   service for the next pairs (``GET /api/tasks``: the order ``/api/tasks/next`` and the ``/annotate``
   page hand them out one at a time), and votes A / B / tie / both bad with a reason that names what each
   answer gives ("B gives '42', the expected answer; A gives '41'"), a batch per ``POST /api/votes/bulk``.
   The service randomises the sides and keeps the true order.
3. **export**: ``posttrain feedback export`` logic writes preference pairs, SFT examples and the
   ``posttrain feedback`` merge input, each with lineage, from the vote log.

The service (``posttrain serve feedback``) runs in its own process on 127.0.0.1 at a free port, over the
run's SQLite file ``<run_dir>/feedback.db``; every call goes through its HTTP API, so the flywheel
exercises exactly what a deployed model's capture hook and a human annotator use.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from posttrain.flywheel.config import FlywheelRecipe

DB_FILE = "feedback.db"
# The model id of an answer the annotator wrote (``feedback.reference_answers``): lineage says no model sampled it.
REFERENCE_MODEL_ID = "annotator-reference"


def db_url(run_dir: Path) -> str:
    return f"sqlite:///{(run_dir / DB_FILE).resolve()}"


def _token(db: Any, run_dir: Path, name: str, role: str) -> str:
    """A user's token, created once per run and kept in ``<run_dir>/feedback_tokens/`` (the service stores
    only its hash), so a re-run of a stage — interrupted, or with changed inputs — acts as the same user,
    and the annotator is not served the pairs it already voted on."""
    folder = run_dir / "feedback_tokens"
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / f"{name}.token"
    if path.exists():
        return path.read_text().strip()
    from posttrain.serve.db import FeedbackDBError

    try:
        token = db.create_user(name, role)
    except FeedbackDBError as exc:  # the name is taken: the token file was lost
        raise RuntimeError(f"{run_dir / DB_FILE}: {exc}, but its token {path} is gone; "
                           "restore the file or start the run in a fresh run_dir") from None
    path.write_text(token)
    path.chmod(0o600)
    return token


@contextmanager
def feedback_service(run_dir: Path, guideline: tuple[str, Path] | None = None):
    """``(base_url, db)`` of the run's feedback service for the duration of the block: ``posttrain serve
    feedback`` in its own process on 127.0.0.1 (a server thread inside this process shared the GIL with
    the client and answered ~10x slower), rate limit off (the only client is this process). ``guideline``
    is ``(version, file)``: shown with every pair and stored with every vote."""
    import httpx

    from posttrain.serve.db import open_db
    from posttrain.serve.pg_local import free_port

    url = db_url(run_dir)
    db = open_db(url)  # applies the migrations before the server starts, so users can be created first
    port = free_port()
    command = [sys.executable, "-m", "posttrain", "serve", "feedback", "--db", url, "--port", str(port), "--rate", "0"]
    if guideline is not None:
        command += ["--guidelines", str(guideline[1]), "--guidelines-version", guideline[0]]
    log_path = run_dir / "feedback-server.log"
    with open(log_path, "ab") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if server.poll() is not None:
                tail = log_path.read_text(errors="replace")[-1500:]
                raise RuntimeError(f"the feedback server exited with code {server.returncode}:\n{tail}")
            try:
                httpx.get(f"{base_url}/api/me", timeout=2)  # 401 without a token: the server is up
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the feedback server did not answer on {base_url} within 60 s") from None
                time.sleep(0.1)
        yield base_url, db
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
        db.close()


def _client(base_url: str, token: str) -> Any:
    import httpx

    return httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=60.0)


def _check(response: Any, what: str) -> dict[str, Any]:
    if response.status_code >= 400:
        raise RuntimeError(f"feedback service refused {what}: HTTP {response.status_code} {response.text[:300]}")
    return response.json() if response.content else {}


def stage_capture(config: FlywheelRecipe, round_index: int, model: str, model_label: str, dev_suite: str,
                  db_dir: Path, out: Path) -> dict[str, Any]:
    """Evaluate ``model`` on the dev suite, post its failures and sampled alternatives to the service."""
    from posttrain.eval.items import load_suite
    from posttrain.eval.verifiers import verify
    from posttrain.flywheel.run import stage_eval
    from posttrain.generate.engine import HFBackend, SamplingParams

    spec = config.feedback
    backend = HFBackend.from_path(model)  # one load: the greedy eval and the alternatives' sampling share it
    evaluated = stage_eval(model, dev_suite, config, out, model_label, backend)
    results = json.loads(Path(evaluated["results"]).read_text())
    failed = [row for row in results["items"] if not row["passed"] and (spec.groups is None or row["group"] in spec.groups)]
    # An empty answer has nothing for an annotator to compare; it is counted, not captured. "Empty" is the
    # service's own rule (invisible characters only, or text it cannot store), which would refuse the case.
    failures = [row for row in failed if _storable(row["output"] or "")]
    source = f"flywheel/round{round_index - 1}/dev"
    greedy_settings = {"temperature": 0.0, "max_new_tokens": config.eval.max_new_tokens}
    sampled_settings = {"temperature": spec.temperature, "max_new_tokens": spec.max_new_tokens,
                        "n": spec.samples, "seed": config.seed + round_index}
    params = SamplingParams(n=spec.samples, temperature=spec.temperature, max_new_tokens=spec.max_new_tokens,
                            seed=config.seed + round_index)
    items = {item.id: item for item in load_suite(dev_suite).items}
    messages = {item_id: item.prompt_messages() for item_id, item in items.items()}  # as the eval prompted
    alternatives = backend.generate([messages[row["id"]] for row in failures], params,
                                    batch_size=spec.batch_size, progress=False) if failures else []
    counts: Counter = Counter()
    with feedback_service(db_dir) as (base_url, db):
        token = _token(db, db_dir, f"flywheel-capture-round{round_index}", "ingest")
        with _client(base_url, token) as client:
            for row, samples in zip(failures, alternatives, strict=True):
                case = {
                    "prompt": row["prompt"],
                    "responses": [{"text": row["output"], "model_id": model_label, "sampling": greedy_settings}],
                    "signal": {"type": "failed_verifier", "detail": row["detail"]},
                    "source": source, "group": row["group"],
                    "metadata": {"dev_item": row["id"], "tier": row["tier"], "verifier": row["verifier"]},
                }  # fmt: skip
                created = _check(client.post("/api/edge-cases", json=case), "an edge case")
                counts["captured" if created["created"] else "already_captured"] += 1
                texts = list(dict.fromkeys(s.text for s in samples if _storable(s.text) and s.text != row["output"]))
                responses = [{"text": t, "model_id": model_label, "sampling": sampled_settings} for t in texts]
                reference = items[row["id"]].answer if spec.reference_answers else None
                if reference is not None and _storable(str(reference)) and str(reference) not in texts and not any(
                        verify(items[row["id"]], text).passed for text in texts):
                    responses.append({"text": str(reference), "model_id": REFERENCE_MODEL_ID, "sampling": {}})
                    counts["reference_answers"] += 1
                if responses:
                    body = {"responses": responses}
                    _check(client.post(f"/api/edge-cases/{created['id']}/responses", json=body), "alternatives")
                    counts["alternatives"] += len(texts)
    groups = Counter(row["group"] for row in failures)
    return {"dev_results": evaluated["results"], "dev_items": len(results["items"]),
            "dev_passed": results["counts"]["passed"], "failures": len(failures), "failures_by_group": dict(groups),
            "empty_failures": len(failed) - len(failures),
            **counts}  # fmt: skip


def _storable(text: str) -> bool:
    """Whether the feedback service stores ``text`` as a response (``posttrain.serve.text``'s rules)."""
    from posttrain.serve.text import is_blank, text_problem

    return not is_blank(text) and text_problem(text) is None


def _short(text: str, limit: int = 60) -> str:
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= limit else flat[: limit - 1] + "…")


def verifier_vote(item: Any, left: str, right: str) -> tuple[str, str]:
    """The scripted annotator's ``(choice, reason)`` for one pair shown as A (left) and B (right)."""
    from posttrain.eval.verifiers import verify

    results = {side: verify(item, text) for side, text in (("A", left), ("B", right))}
    texts = {"A": left, "B": right}
    expected = f"the expected answer is {_short(str(item.answer))}" if item.answer is not None else "it passes"
    passed = [side for side in ("A", "B") if results[side].passed]
    if len(passed) == 1:
        good, bad = passed[0], "B" if passed[0] == "A" else "A"
        detail = results[bad].detail or "fails the check"
        reason = f"{good} gives {_short(texts[good])} and {expected}; {bad} gives {_short(texts[bad])} ({detail})"
        return ("left" if good == "A" else "right"), reason
    if len(passed) == 2:
        return "tie", f"both pass the check: A gives {_short(left)}, B gives {_short(right)}; {expected}"
    return "both_bad", (f"neither passes: A gives {_short(left)} ({results['A'].detail}), B gives {_short(right)} "
                        f"({results['B'].detail}); {expected}")


def stage_annotate(config: FlywheelRecipe, round_index: int, dev_suite: str, db_dir: Path, out: Path
                   ) -> dict[str, Any]:
    """Vote on every open pair as the scripted verifier annotator, through the annotator API."""
    from posttrain.eval.items import content_hash, load_suite
    from posttrain.serve.models import MAX_BATCH

    items = {content_hash(item.prompt): item for item in load_suite(dev_suite).items}  # str or chat alike
    counts: Counter = Counter()
    guideline = out / "guideline.txt"
    guideline.write_text(config.feedback.guideline, encoding="utf-8")
    with feedback_service(db_dir, (config.feedback.guideline_version, guideline)) as (base_url, db):
        token = _token(db, db_dir, f"flywheel-verifier-round{round_index}", "annotator")
        with _client(base_url, token) as client:
            # A batch of tasks per call and their votes in one call: the order and the votes are those of one
            # GET /api/tasks/next and one POST /api/votes per pair, without ~9 ms of HTTP and ranking each.
            while tasks := _check(client.get("/api/tasks", params={"limit": MAX_BATCH}), "the next tasks")["tasks"]:
                votes = []
                for task in tasks:
                    item = items.get(content_hash(task["prompt"]))
                    if item is None:  # a case someone else captured: this annotator has no answer key for it
                        choice, reason = "tie", "no answer key for this prompt: cannot tell (scripted verifier)"
                        counts["no_key"] += 1
                    else:
                        choice, reason = verifier_vote(item, task["left"]["text"], task["right"]["text"])
                    votes.append({"task_id": task["task_id"], "choice": choice, "reason": reason})
                    counts[choice] += 1
                stored = _check(client.post("/api/votes/bulk", json={"votes": votes}), "the votes")
                if stored["rejected"]:
                    refused = next(result for result in stored["results"] if result["status"] != 201)
                    raise RuntimeError(f"feedback service refused {stored['rejected']} of {len(votes)} votes, e.g. "
                                       f"{votes[refused['index']]['task_id']}: HTTP {refused['status']} "
                                       f"{refused['error']}")
    return {"votes": sum(counts[c] for c in ("left", "right", "tie", "both_bad")), **counts}


def stage_export(db_dir: Path, out: Path) -> dict[str, Any]:
    from posttrain.serve.db import open_db
    from posttrain.serve.export import export_feedback

    db = open_db(db_url(db_dir))
    try:
        manifest = export_feedback(db, out, min_votes=1)
    finally:
        db.close()
    return {"feedback": str(out / "feedback.jsonl"), "preferences": str(out / "preferences.jsonl"),
            "sft": str(out / "sft.jsonl"), "counts": manifest["counts"], "skipped": manifest["skipped"]}
