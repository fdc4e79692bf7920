"""``posttrain feedback export``: the vote log → preference pairs, SFT examples and ``posttrain feedback`` records.

The export reads the append-only vote log (optionally up to a vote id or a time, ``--until``) and nothing
else that changes, so the same log always exports to the same bytes. For each pair (response 0, response i)
it takes **each annotator's latest vote** (a changed mind replaces the earlier vote of the same annotator)
and decides by plurality over those votes:

- fewer than ``min_votes`` annotators: skipped (``below_min_votes``);
- one label has strictly more votes than every other: that is the outcome. If it names a response, the pair
  is exported (chosen = that response, rejected = the other); if it is ``tie`` or ``both_bad``, nothing is
  exported (``tie`` / ``both_bad``: there is nothing to prefer or imitate);
- two or more labels share the top count: skipped (``no_majority``), disagreement is not resolved by chance.

``agreement`` is the share of the pair's annotators whose latest vote is the outcome; ``rationale`` /
``reason`` are those annotators' reasons, in vote order, one per line. Every record carries ``lineage``:
edge case id, source, signal, group and metadata, the two responses' ids, model ids and sampling settings,
the votes counted (annotator, choice, time, guideline version) and a content hash of the record.

Files: ``preferences.jsonl`` (``prompt``, ``chosen``, ``rejected``, ``rationale``, ``agreement``,
``annotators``, ``lineage``; loadable by ``posttrain dpo``), ``sft.jsonl`` (``messages`` + ``lineage``;
``posttrain sft``), ``feedback.jsonl`` (``prompt``, ``bad_response``, ``better_response``, ``reason``,
``id``; the input of ``posttrain feedback``) and ``manifest.json`` (counts, skips by reason, the SHA-256
of the vote log read and of every file written). Extra keys such as ``lineage`` are kept by posttrain's
readers in each record's ``meta``.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from posttrain.data.records import stable_id
from posttrain.serve.db import FeedbackDB, FeedbackDBError, canonical_json

EXPORT_FORMAT = "posttrain.feedback-export/1"


def parse_until(until: str | None) -> tuple[int | None, str | None]:
    """``--until``: a vote id (digits) or an ISO-8601 time (naive = UTC) → ``(until_id, until_time)``."""
    if until is None:
        return None, None
    if until.isdigit():
        return int(until), None
    try:
        moment = datetime.fromisoformat(until)
    except ValueError:
        raise FeedbackDBError(f"--until {until!r}: give a vote id (e.g. 120) or an ISO time (e.g. 2025-01-31T12:00:00Z)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return None, moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def vote_label(vote: dict[str, Any]) -> str:
    """A vote's outcome in the pair's canonical order: ``a`` (response 0), ``b``, ``tie`` or ``both_bad``."""
    if vote["winner"] == vote["response_a_id"]:
        return "a"
    if vote["winner"] == vote["response_b_id"]:
        return "b"
    return vote["winner"]


def latest_votes(votes: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Pair → each annotator's latest vote on it (in vote order), from a vote log ordered by id."""
    latest: dict[tuple[str, str], dict[int, dict[str, Any]]] = defaultdict(dict)
    for vote in votes:
        latest[(vote["response_a_id"], vote["response_b_id"])][vote["annotator_id"]] = vote
    return {pair: sorted(by_annotator.values(), key=lambda v: v["id"]) for pair, by_annotator in latest.items()}


def decide(labels: list[str], min_votes: int) -> tuple[str | None, str | None]:
    """``(outcome, skip_reason)`` of one pair's latest labels under the plurality rule in the module docstring."""
    if len(labels) < min_votes:
        return None, "below_min_votes"
    counts = Counter(labels).most_common()
    if len(counts) > 1 and counts[0][1] == counts[1][1]:
        return None, "no_majority"
    top = counts[0][0]
    return (top, None) if top in ("a", "b") else (None, top)


def _chat(prompt: Any) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def _side(response: dict[str, Any]) -> dict[str, Any]:
    return {"response_id": response["id"], "position": response["position"], "model_id": response["model_id"],
            "sampling": json.loads(response["sampling"])}


def _records(case: dict[str, Any], votes: list[dict[str, Any]], outcome: str) -> dict[str, dict[str, Any]]:
    prompt = json.loads(case["prompt"])
    responses = {r["id"]: r for r in case["responses"]}
    a, b = responses[votes[0]["response_a_id"]], responses[votes[0]["response_b_id"]]
    chosen, rejected = (a, b) if outcome == "a" else (b, a)
    agreeing = [v for v in votes if vote_label(v) == outcome]
    rationale = "\n".join(v["reason"].strip() for v in agreeing)
    content = {"prompt": prompt, "chosen": chosen["text"], "rejected": rejected["text"], "rationale": rationale}
    lineage = {
        "edge_case_id": case["id"], "source": case["source"], "signal": json.loads(case["signal"]),
        "group": case["group_name"], "metadata": json.loads(case["metadata"]),
        "chosen": _side(chosen), "rejected": _side(rejected),
        "annotators": [v["annotator"] for v in votes],
        "votes": [{"vote_id": v["id"], "annotator": v["annotator"], "choice": vote_label(v), "created_at": v["created_at"],
                   "guideline_version": v["guideline_version"]} for v in votes],
        "guideline_versions": sorted({v["guideline_version"] for v in votes if v["guideline_version"]}),
        "content_hash": hashlib.sha256(canonical_json(content).encode("utf-8")).hexdigest(),
    }  # fmt: skip
    pair_id = stable_id([case["id"], a["id"], b["id"]], "fb-")
    agreement = round(len(agreeing) / len(votes), 6)
    annotators = [v["annotator"] for v in agreeing]
    return {
        "preferences": {"id": pair_id, "prompt": prompt, "chosen": chosen["text"], "rejected": rejected["text"],
                        "rationale": rationale, "agreement": agreement, "annotators": annotators, "lineage": lineage},
        "sft": {"id": pair_id, "messages": [*_chat(prompt), {"role": "assistant", "content": chosen["text"]}],
                "lineage": lineage},
        "feedback": {"id": pair_id, "prompt": prompt, "bad_response": rejected["text"],
                     "better_response": chosen["text"], "reason": rationale, "lineage": lineage},
    }  # fmt: skip


def export_feedback(db: FeedbackDB, out_dir: str | Path, min_votes: int = 1, until: str | None = None) -> dict[str, Any]:
    """Write the export files into ``out_dir``; return the manifest (also written as ``manifest.json``)."""
    from posttrain.data.io import write_jsonl
    from posttrain.data.storage import sha256_file

    if min_votes < 1:
        raise FeedbackDBError(f"--min-votes must be at least 1 (got {min_votes})")
    until_id, until_time = parse_until(until)
    log = db.vote_log(until_id, until_time)
    log_hash = hashlib.sha256("\n".join(canonical_json(v) for v in log).encode("utf-8")).hexdigest()
    by_pair = latest_votes(log)
    cases: dict[str, dict[str, Any]] = {}
    for case_id in sorted({votes[0]["edge_case_id"] for votes in by_pair.values()}):
        cases[case_id] = db.edge_case(case_id)  # type: ignore[assignment]

    def order(pair: tuple[str, str]) -> tuple:
        case = cases[by_pair[pair][0]["edge_case_id"]]
        position = next(r["position"] for r in case["responses"] if r["id"] == pair[1])
        return case["created_at"], case["id"], position

    rows: dict[str, list[dict[str, Any]]] = {"preferences": [], "sft": [], "feedback": []}
    skipped: Counter = Counter()
    for pair in sorted(by_pair, key=order):
        votes = by_pair[pair]
        outcome, skip = decide([vote_label(v) for v in votes], min_votes)
        if skip:
            skipped[skip] += 1
            continue
        for name, record in _records(cases[votes[0]["edge_case_id"]], votes, outcome).items():  # type: ignore[arg-type]
            rows[name].append(record)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, records in rows.items():
        path = out / f"{name}.jsonl"
        files[path.name] = {"rows": write_jsonl(str(path), records), "sha256": sha256_file(path)}
    manifest = {
        "format": EXPORT_FORMAT,
        "schema_version": db.schema_version(),
        "min_votes": min_votes,
        "until": until,
        "vote_log": {"votes": len(log), "last_vote_id": log[-1]["id"] if log else None, "sha256": log_hash},
        "counts": {"pairs_with_votes": len(by_pair), "exported": len(rows["preferences"]),
                   "annotators": len({v["annotator_id"] for v in log})},
        "skipped": dict(sorted(skipped.items())),
        "files": files,
        "rule": "each annotator's latest vote per pair; strict plurality; tie/both_bad/no majority not exported",
    }  # fmt: skip
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return manifest
