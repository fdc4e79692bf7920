"""``posttrain feedback``: merge edge cases into the next round's SFT and preference sets.

A feedback record is ``{"prompt", "bad_response", "better_response", "reason"}`` (``prompt`` may be
a string or a chat; an ``id`` is kept when given). Each becomes an SFT example (prompt → better
response) and a preference pair (chosen = better, rejected = bad, rationale = reason, kept
verbatim). New records are deduplicated against the existing sets and each other, exactly
(normalised text) and near-exactly (MinHash LSH, ``near_dedup`` settings), and appended after the
existing records, which are copied record for record. The manifest lists all three inputs as parents.

Every input is read through ``posttrain.data.io`` (JSONL, JSON, Parquet, saved datasets, ``.gz``):
feedback lines that cannot be used are dropped with a named reason; the existing sets must be valid
training data of their kind, and a bad record in them stops the merge naming file, line and field.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from posttrain.curate.config import FeedbackRecipe, NearDedupConfig
from posttrain.curate.dedup import exact_hashes
from posttrain.curate.funnel import Funnel, format_funnel, write_manifest
from posttrain.curate.minhash import MinHasher, near_duplicate_clusters
from posttrain.curate.rows import Drop, drop_for
from posttrain.data.errors import DataError
from posttrain.data.formats import BLANK_LINE, FormatError, convert, parse_prompt
from posttrain.data.io import BadLine, iter_raw_records, write_jsonl
from posttrain.data.records import PreferencePair, Record, SFTExample, stable_id

_KIND = {"sft": "sft", "preferences": "preference"}


def _record_text(record: Record) -> str:
    """The text an existing record is deduplicated on: every message of the chat, or of prompt, chosen, rejected."""
    if isinstance(record, PreferencePair):
        parts = (record.prompt, record.chosen, record.rejected)
        return "\n".join("\n".join(m.content for m in part) for part in parts)
    return "\n".join(m.content for m in record.messages)  # type: ignore[union-attr]


def existing_texts(path: str | None, target: str) -> tuple[list[dict[str, Any]], list[str]]:
    """``(records, texts)`` of an existing set (``target`` ``sft`` or ``preferences``): every record as
    it was read, and the text used for dedup. The set must be valid training data: a bad record stops
    the merge with ``DataError`` naming file, line and field, rather than being carried into the next round."""
    if path is None:
        return [], []
    if not Path(path).exists():
        raise FileNotFoundError(f"{path}: existing {target} set not found")
    records, texts = [], []
    for line, item in iter_raw_records(path):
        if isinstance(item, BadLine):
            if item.category == BLANK_LINE:
                continue
            raise DataError(path, line, None, item.reason)
        try:
            record, _ = convert(item, kind=_KIND[target])
        except FormatError as exc:
            raise DataError(path, line, exc.field, exc.reason) from None
        records.append(item)
        texts.append(_record_text(record))
    return records, texts


def parse_feedback(item: dict[str, Any] | BadLine) -> dict[str, Any] | Drop:
    """One decoded feedback line → ``{"id", "prompt", "bad", "better", "reason"}``, or a named ``Drop``."""
    if isinstance(item, BadLine):
        return drop_for(item)
    missing = [k for k in ("prompt", "bad_response", "better_response") if k not in item]
    if missing:
        return Drop("missing_field", f"missing {', '.join(missing)}")
    try:
        prompt = parse_prompt(item["prompt"], "prompt")
    except FormatError as exc:
        return drop_for(exc)
    bad, better = item["bad_response"], item["better_response"]
    if not isinstance(bad, str) or not isinstance(better, str) or not better.strip() or not bad.strip():
        return Drop("bad_field", "bad_response and better_response must be non-empty strings")
    if " ".join(bad.split()) == " ".join(better.split()):
        return Drop("identical_responses", "the better response is the bad one")
    return {"id": item.get("id"), "prompt": [m.model_dump() for m in prompt], "bad": bad, "better": better,
            "reason": str(item.get("reason") or "")}  # fmt: skip


def duplicates_of_earlier(texts: list[str], config: NearDedupConfig) -> dict[int, str]:
    """Position → ``exact_duplicate`` / ``near_duplicate`` for each text equal or near-equal to an earlier one."""
    found: dict[int, str] = {}
    hashes = exact_hashes(texts)
    first_seen: dict[int, int] = {}
    for position, value in enumerate(hashes.tolist()):
        if texts[position] and value in first_seen:
            found[position] = "exact_duplicate"
        first_seen.setdefault(value, position)
    hasher = MinHasher(config.num_perm, config.shingle_size, config.seed, shingle=config.shingle)
    signatures, values, offsets = hasher.sign(texts, with_sets=config.verify == "exact")
    labels, _ = near_duplicate_clusters(
        signatures, config.bands, config.rows, config.threshold, verify=config.verify,
        shingle_set_of=lambda i: values[offsets[i] : offsets[i + 1]],
        valid=signatures[:, 0] != np.uint32(0xFFFFFFFF), max_bucket=config.max_bucket,
    )  # fmt: skip
    for position in np.flatnonzero(labels != np.arange(labels.size)):
        found.setdefault(int(position), "near_duplicate")
    return found


def ingest_feedback(config: FeedbackRecipe) -> dict:
    output = Path(config.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    if not Path(config.feedback).exists():
        raise FileNotFoundError(f"{config.feedback}: feedback file not found")
    records: list[tuple[int, dict[str, Any]]] = []
    dropped: list[dict[str, Any]] = []
    parse_reasons: Counter = Counter()
    total = 0
    for number, item in iter_raw_records(config.feedback):
        total += 1
        parsed = parse_feedback(item)
        if isinstance(parsed, Drop):
            parse_reasons[parsed.reason] += 1
            dropped.append({"line": number, "target": "both", "stage": "parse", "reason": parsed.reason,
                            "detail": parsed.detail, "record": item.raw if isinstance(item, BadLine) else item})
        else:
            records.append((number, parsed))
    summary: dict[str, Any] = {"input": total}
    outputs: dict[str, Path] = {}
    for target in ("sft", "preferences"):
        funnel = Funnel(["parse", "dedup"])
        funnel.input = total
        funnel.add("parse", total, len(records), parse_reasons)
        existing_path = config.sft if target == "sft" else config.preferences
        old_records, old_texts = existing_texts(existing_path, target)
        new = [_build(target, number, record, config) for number, record in records]
        new_texts = [_dedup_text(target, record) for _, record in records]
        duplicates = duplicates_of_earlier(old_texts + new_texts, config.near_dedup)
        added: list[dict[str, Any]] = []
        reasons: Counter = Counter()
        for position, ((number, record), built) in enumerate(zip(records, new, strict=True)):
            duplicate = duplicates.get(len(old_texts) + position)
            drop = Drop(duplicate, "of an existing or earlier record") if duplicate else built
            if isinstance(drop, Drop):
                reasons[drop.reason] += 1
                dropped.append({"line": number, "target": target, "stage": "dedup", "reason": drop.reason,
                                "detail": drop.detail, "record": record})  # fmt: skip
            else:
                added.append(built)
        funnel.add("dedup", len(records), len(added), reasons)
        funnel.check(len(added))
        summary[target] = {**funnel.to_dict(len(added)), "existing": len(old_records), "total": len(old_records) + len(added)}
        outputs[target] = output / f"{target}.jsonl"
        write_jsonl(str(outputs[target]), [*old_records, *added])
    dropped.sort(key=lambda record: (record["line"], record["target"]))
    outputs["dropped"] = output / "dropped.jsonl"
    write_jsonl(str(outputs["dropped"]), dropped)
    (output / "funnel.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    parents = [p for p in (config.feedback, config.sft, config.preferences) if p]
    return write_manifest(output, "feedback", outputs, parents, config, summary, exclude={"output_dir"})


def _dedup_text(target: str, record: dict[str, Any]) -> str:
    prompt = "\n".join(m["content"] for m in record["prompt"])
    if target == "sft":
        return f"{prompt}\n{record['better']}"
    return f"{prompt}\n{record['better']}\n{record['bad']}"


def _build(target: str, number: int, record: dict[str, Any], config: FeedbackRecipe) -> dict[str, Any] | Drop:
    """The new SFT example or preference pair, validated; a ``Drop`` when it is not valid."""
    meta = {"feedback": {"id": record["id"], "line": number, "reason": record["reason"], "source": config.feedback}}
    better = {"role": "assistant", "content": record["better"]}
    try:
        if target == "sft":
            example = SFTExample(messages=[*record["prompt"], better], tier=config.tier, meta=meta)
        else:
            example = PreferencePair(
                prompt=record["prompt"], chosen=[better], rejected=[{"role": "assistant", "content": record["bad"]}],
                rationale=record["reason"] or None, tier=config.tier, meta=meta,
            )  # fmt: skip
    except ValidationError as exc:
        return Drop(f"invalid_{target}_record", str(exc.errors()[0]["msg"]))
    data = example.model_dump(mode="json")
    if record["id"]:
        data["id"] = stable_id([record["id"], target], "fb-")
    return data


def run_feedback(config: FeedbackRecipe) -> int:
    summary = ingest_feedback(config)["funnel"]
    for target in ("sft", "preferences"):
        print(f"[{target}] existing {summary[target]['existing']}, total {summary[target]['total']}")
        print(format_funnel({k: v for k, v in summary[target].items() if k not in ("existing", "total")}))
    print(f"merged sets → {config.output_dir}/sft.jsonl, preferences.jsonl (manifest.json lists the parents)")
    return 0
