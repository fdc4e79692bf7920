"""Bulk import of edge cases into a running service: from JSONL (one ``POST /api/edge-cases`` body a line)
or from ``posttrain eval -o results.json`` (every item whose verifier failed becomes an edge case).

An eval failure is captured as ``prompt`` = the item's prompt, response 0 = the model's output (model id
and sampling settings from the results), ``signal`` = ``{"type": "failed_verifier", "detail": <the
verifier's detail>}``, ``source`` = ``eval:<suite>``, ``group`` = the item's group, and ``metadata`` =
the item's id, tier, verifier, expected answer, score and content hash, so that a later round can
answer and judge it against the expected answer. Items without an output (missing) are not failures of
the model and are skipped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

BATCH_BYTES = 4 << 20  # per bulk request, well under the server's default 16 MiB


def eval_failures(results: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The edge cases in an eval results dict (``posttrain.eval.harness.evaluate``'s return value)."""
    sampling = (results.get("config") or {}).get("sampling") or {}
    model = results.get("model") or "unknown"
    for item in results.get("items", []):
        if item.get("passed") or item.get("output") is None or not str(item["output"]).strip():
            continue
        yield {
            "prompt": item["prompt"],
            "responses": [{"text": item["output"], "model_id": str(model), "sampling": sampling}],
            "signal": {"type": "failed_verifier", "detail": item.get("detail")},
            "source": f"eval:{results.get('suite', 'unknown')}",
            "group": item.get("group"),
            "metadata": {"eval_item_id": item["id"], "tier": item.get("tier"), "verifier": item.get("verifier"),
                         "answer": item.get("answer"), "score": item.get("score"),
                         "content_hash": item.get("content_hash")},
        }  # fmt: skip


def read_source(jsonl: str | None = None, eval_results: str | None = None) -> list[bytes]:
    """The JSONL lines to send (bytes, one edge case each)."""
    if eval_results is not None:
        results = json.loads(Path(eval_results).read_text(encoding="utf-8"))
        return [json.dumps(case, ensure_ascii=False).encode("utf-8") for case in eval_failures(results)]
    assert jsonl is not None
    return [line for line in Path(jsonl).read_bytes().split(b"\n") if line.strip()]


def _batches(lines: list[bytes]) -> Iterable[tuple[int, list[bytes]]]:
    start, batch, size = 0, [], 0
    for index, line in enumerate(lines):
        if batch and size + len(line) + 1 > BATCH_BYTES:
            yield start, batch
            start, batch, size = index, [], 0
        batch.append(line)
        size += len(line) + 1
    if batch:
        yield start, batch


def import_lines(server: str, token: str, lines: list[bytes], timeout_s: float = 120.0) -> dict[str, Any]:
    """Send ``lines`` to ``server``'s bulk endpoint; return counts and the rejected lines (line numbers of ``lines``)."""
    import httpx

    totals: dict[str, Any] = {"created": 0, "existing": 0, "rejected": 0, "errors": []}
    with httpx.Client(base_url=server.rstrip("/"), headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s) as client:
        for start, batch in _batches(lines):
            while True:
                reply = client.post("/api/edge-cases/bulk", content=b"\n".join(batch),
                                    headers={"Content-Type": "application/x-ndjson"})
                if reply.status_code != 429:
                    break
                time.sleep(float(reply.headers.get("Retry-After", "1")))
            if reply.status_code != 200:
                raise RuntimeError(f"{server} refused the import ({reply.status_code}): {reply.text[:500]}")
            body = reply.json()
            for key in ("created", "existing", "rejected"):
                totals[key] += body[key]
            totals["errors"] += [{**r, "line": start + r["line"]} for r in body["results"] if "error" in r]
    return totals
