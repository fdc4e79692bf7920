"""``posttrain data inspect FILE``: what is in a data file, how long it is in tokens, and what is wrong with it.

Prints the detected format(s), record counts by kind, the token-length distribution under a model's
tokenizer (``--model``) with how many records exceed ``--max-length``, and bad records by reason.

An inspection counts every bad record by default (``--on-error count``): the whole file is read, the
table shows each reason with its count and first lines, and the exit code is 2 when any record is bad,
since a run with the default ``data.on_error=raise`` would stop at the first of them. ``quarantine``
shows the same and exits 0 (a run with ``data.on_error=quarantine`` sets them aside); both write the
bad records to ``--quarantine-file`` when given. ``raise`` stops at the first bad record with
``file:line: field: reason`` and exit 2, as the run would.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from posttrain.data.formats import FORMATS
from posttrain.data.records import RECORD_KINDS, PreferencePair, Record, RLPrompt, SFTExample

DEFAULT_MAX_LENGTH = 512  # the default of train.max_length
_PERCENTILES = (50, 90, 99)

if TYPE_CHECKING:
    from posttrain.data.io import ReadReport


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("data", help="Data tools: inspect a data file (formats, counts, lengths, errors); write the built-in tasks.")
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    inspect = sub.add_parser(
        "inspect",
        help="Show a data file's format, record counts by kind, token lengths and bad records by reason.",
        description=(
            "Read FILE (.jsonl, .json, .parquet, optionally .gz, or a directory saved by datasets.save_to_disk), "
            "detect its format per record, count records by kind, and, with --model, show the token-length "
            "distribution under that model's chat template and how many records exceed --max-length. Every bad "
            "record is counted by reason (exit 2 when any is bad; --on-error quarantine: exit 0; --on-error raise: "
            "stop at the first with file:line: field: reason)."
        ),
    )
    inspect.add_argument("file", help="data file or saved-dataset directory")
    inspect.add_argument("--model", help="HF model/tokenizer directory: adds token-length statistics")
    inspect.add_argument("--format", default="auto", choices=("auto", *FORMATS),
                         help="force a format instead of detecting it per record (default: auto)")
    inspect.add_argument("--kind", choices=tuple(RECORD_KINDS),
                         help="expected record kind; records of another kind count as bad")
    inspect.add_argument("--max-length", type=int, default=DEFAULT_MAX_LENGTH,
                         help=f"count records longer than this many tokens (default {DEFAULT_MAX_LENGTH})")
    inspect.add_argument("--on-error", choices=("count", "quarantine", "raise"), default="count",
                         help="count (default): read the whole file, count bad records by reason, exit 2 if any; "
                         "quarantine: the same, exit 0 (what a run with data.on_error=quarantine accepts); "
                         "raise: stop at the first bad record (exit 2), as a run with data.on_error=raise does")
    inspect.add_argument("--quarantine-file", help="also write the bad records here (JSONL; not with --on-error raise)")
    inspect.add_argument("--limit", type=int, default=None,
                         help="tokenise at most this many records for the length statistics (default: all)")
    inspect.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    inspect.set_defaults(func=_inspect)
    from posttrain.data.builtin_tasks import add_parser

    add_parser(sub)


# ------------------------------------------------------------------------------------ statistics


def _record_length(record: Record, tokenizer) -> int:
    """Tokens the record occupies in training: the whole chat, the longer side of a pair, or the prompt."""
    from posttrain.data.chat import encode_prompt
    from posttrain.data.tokenize import tokenize_chat_rows, tokenize_prompt_completion

    unlimited = 1 << 62
    if isinstance(record, SFTExample):  # a template that rewrites history gives one row per turn: the longest
        return max(len(row) for row in tokenize_chat_rows(record, tokenizer, unlimited))
    if isinstance(record, PreferencePair):
        return max(len(tokenize_prompt_completion(record.prompt, side, tokenizer, unlimited))
                   for side in (record.chosen, record.rejected))
    assert isinstance(record, RLPrompt)
    return len(encode_prompt(tokenizer, record.prompt))  # the ids generation samples from (implicit BOS included)


def length_stats(lengths: list[int], max_length: int) -> dict[str, Any]:
    """min / percentiles / max of token lengths (percentiles are actual lengths: inverted-CDF rule)."""
    import numpy as np

    if not lengths:
        return {"count": 0, "over_max_length": 0}
    values = np.asarray(lengths)
    stats: dict[str, Any] = {"count": len(lengths), "min": int(values.min())}
    for q in _PERCENTILES:
        stats[f"p{q}"] = int(np.percentile(values, q, method="inverted_cdf"))
    stats["max"] = int(values.max())
    stats["mean"] = round(float(values.mean()), 1)
    stats["over_max_length"] = int((values > max_length).sum())
    return stats


def _token_stats(records: list[Record], model: str, max_length: int, limit: int | None) -> dict[str, Any]:
    from posttrain.models.load import load_tokenizer
    from posttrain.progress import progress

    tokenizer = load_tokenizer(model)
    chosen = records if limit is None else records[:limit]
    by_kind: dict[str, list[int]] = {}
    for record in progress(chosen, desc="measuring token lengths", unit="rec"):
        by_kind.setdefault(record.kind, []).append(_record_length(record, tokenizer))
    return {kind: length_stats(lengths, max_length) for kind, lengths in by_kind.items()}


# ------------------------------------------------------------------------------------ output


def _table(header: list[str], rows: list[list[Any]], indent: str = "    ") -> list[str]:
    """An aligned plain-text table: numeric columns right-aligned, text columns left-aligned."""
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    numeric = [all(isinstance(row[i], int | float) for row in rows) for i in range(len(header))]
    lines = []
    for row in cells:
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric, strict=True)]
        lines.append(indent + "  ".join(parts).rstrip())
    return lines


def _counts(counter) -> str:
    return ", ".join(f"{name} {count}" for name, count in counter.most_common()) or "none"


def format_text(report: ReadReport, tokens: dict[str, Any] | None, args: argparse.Namespace) -> str:
    lines = [f"data inspect: {report.path}"]
    lines.append(f"  records   read {report.read} = accepted {report.accepted} + quarantined {report.quarantined}"
                 + (f" ({report.blank_lines} blank lines skipped)" if report.blank_lines else ""))
    lines.append(f"  format    {_counts(report.formats)}" + ("" if args.format == "auto" else " (forced)"))
    lines.append(f"  kinds     {_counts(report.kinds)}")
    if tokens is not None:
        limited = f", first {args.limit} records" if args.limit is not None else ""
        lines.append(f"  tokens    under {args.model}'s chat template{limited}")
        header = ["kind", "count", "min", "p50", "p90", "p99", "max", "mean", f"> {args.max_length}"]
        rows = [[kind, s["count"], s.get("min", "-"), s.get("p50", "-"), s.get("p90", "-"), s.get("p99", "-"),
                 s.get("max", "-"), s.get("mean", "-"), s["over_max_length"]] for kind, s in tokens.items()]
        lines += _table(header, rows)
        over = sum(s["over_max_length"] for s in tokens.values())
        lines.append(f"  {over} record(s) would be truncated at --max-length {args.max_length}")
    else:
        lines.append("  tokens    (give --model DIR for token lengths)")
    if report.quarantined:
        lines.append("  bad records")
        rows = [[reason, count, ", ".join(map(str, report.example_lines.get(reason, [])))]
                for reason, count in report.reasons.most_common()]
        lines += _table(["reason", "count", "first lines"], rows)
        if report.quarantine_path:
            lines.append(f"  quarantined records written to {report.quarantine_path}")
    else:
        lines.append("  bad records: none")
    return "\n".join(lines)


def _inspect(args: argparse.Namespace) -> int:
    from posttrain.data.io import read_records  # fsspec: only when a file is read, not for --help

    if args.quarantine_file and args.on_error == "raise":
        print("posttrain: --quarantine-file needs --on-error count or quarantine", file=sys.stderr)
        return 2
    on_error = "raise" if args.on_error == "raise" else "quarantine"  # count reads as quarantine does
    records, report = read_records(
        args.file, kind=args.kind, fmt=args.format, on_error=on_error, quarantine_path=args.quarantine_file
    )
    tokens = None
    if args.model:
        from posttrain.data.tokenize import TemplateError

        try:
            tokens = _token_stats(records, args.model, args.max_length, args.limit)
        except TemplateError as exc:
            print(f"posttrain: {args.model}: {exc}", file=sys.stderr)
            return 2
    if args.json:
        payload = {"report": report.to_dict(), "max_length": args.max_length, "model": args.model, "tokens": tokens}
        print(json.dumps(payload, sort_keys=True))
    else:
        print(format_text(report, tokens, args))
    if report.quarantined and args.on_error == "count":
        print(f"posttrain: {report.path}: {report.quarantined} bad record{'s' if report.quarantined != 1 else ''}, "
              f"the first at {_first_bad_line(report)}: a run with data.on_error=raise (the default) stops there, "
              "data.on_error=quarantine sets them aside (--on-error quarantine here exits 0)", file=sys.stderr)
        return 2
    return 0


def _first_bad_line(report: ReadReport) -> str:
    """``line N`` of the earliest bad record the report kept (``shard:N`` in a shard set)."""
    lines = [line for kept in report.example_lines.values() for line in kept]
    numbers = [line for line in lines if isinstance(line, int)]
    if numbers:
        return f"line {min(numbers)}"

    def order(label: str) -> tuple[str, int]:
        name, _, number = str(label).rpartition(":")
        return name, int(number) if number.isdigit() else 0

    return min(map(str, lines), key=order) if lines else "an unknown line"
