"""``posttrain serve …`` and ``posttrain feedback export``: the feedback service's commands.

    posttrain serve feedback [--db URL] [--host H] [--port P] [--guidelines FILE --guidelines-version V]
                             [--session-secret-file FILE] [limits: --rate, --burst, --max-…]
    posttrain serve user add NAME --role admin|annotator|ingest [--db URL]     (prints the token once)
    posttrain serve import --server URL --token T (--jsonl FILE | --eval-results FILE)
    posttrain feedback export [--db URL] --out DIR [--min-votes K] [--until VOTE_ID_OR_TIME]

Building these parsers imports nothing heavy: the web framework and the database drivers are imported
only when a command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

DB_HELP = "sqlite:///PATH (default sqlite:///feedback.db) or postgresql://user@host:port/db; env POSTTRAIN_FEEDBACK_DB"


def _db_default() -> str:
    return os.environ.get("POSTTRAIN_FEEDBACK_DB", "sqlite:///feedback.db")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="Services: `serve feedback` (capture edge cases, annotate pairs with reasons), users, import.",
        description=__doc__.split("\n", 2)[2] if __doc__ else None, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    actions = parser.add_subparsers(dest="serve_action", metavar="ACTION")
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])

    feedback = actions.add_parser(
        "feedback", help="Run the feedback service (capture API, /annotate, /admin) on uvicorn.",
        description="Run the feedback service: the capture and annotation API, the /login, /annotate and /admin "
        "pages. Schema migrations are applied at start. Create users first with `posttrain serve user add`.",
    )  # fmt: skip
    feedback.add_argument("--db", default=_db_default(), help=DB_HELP)
    feedback.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, loopback only)")
    feedback.add_argument("--port", type=int, default=8000)
    feedback.add_argument("--guidelines", metavar="FILE", help="guideline text shown beside the annotation page")
    feedback.add_argument("--guidelines-version", metavar="V", help="its version (stored with every vote)")
    feedback.add_argument("--rate", type=float, default=20.0, help="requests/s per token (0: no limit; default 20)")
    feedback.add_argument("--burst", type=int, default=60, help="requests one token may make at once (default 60)")
    feedback.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest JSON request (default 1 MiB)")
    feedback.add_argument("--max-bulk-bytes", type=int, default=16 << 20, help="largest bulk JSONL request (16 MiB)")
    feedback.add_argument("--max-text-chars", type=int, default=100_000,
                          help="longest prompt, response, signal detail or reason (default 100000)")
    feedback.add_argument("--max-json-chars", type=int, default=32_768, help="largest sampling, signal detail or "
                          "metadata object, as stored JSON (default 32768)")
    feedback.add_argument("--session-secret-file", metavar="FILE", help="sign page sessions with the secret in FILE "
                          "(created 0600 if missing) so they survive restarts and work across processes; without "
                          "it a secret is drawn at start and a restart logs everyone out of the pages")
    feedback.add_argument("--secure-cookies", action="store_true", help="send the session cookie over HTTPS only "
                          "(set this behind a TLS proxy)")
    feedback.set_defaults(func=_serve)

    user = actions.add_parser("user", help="Manage users: `serve user add NAME --role ROLE`.")
    user_actions = user.add_subparsers(dest="user_action", metavar="ACTION")
    user.set_defaults(func=lambda args: (user.print_help(), 2)[1])
    add = user_actions.add_parser("add", help="Create a user and print their token (shown once, stored hashed).")
    add.add_argument("name")
    add.add_argument("--role", required=True, choices=("admin", "annotator", "ingest"))
    add.add_argument("--db", default=_db_default(), help=DB_HELP)
    add.set_defaults(func=_user_add)

    imp = actions.add_parser("import", help="Bulk-load edge cases into a running service (JSONL or eval results).",
                             description="Send edge cases to a running service's bulk endpoint. --jsonl: one "
                             "POST /api/edge-cases body per line. --eval-results: a `posttrain eval -o` results "
                             "file; every item whose verifier failed becomes an edge case (signal failed_verifier, "
                             "the item's group, tier and expected answer in metadata). Repeats are idempotent.")
    imp.add_argument("--server", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    imp.add_argument("--token", default=os.environ.get("POSTTRAIN_FEEDBACK_TOKEN"),
                     help="an ingest or admin token (default: env POSTTRAIN_FEEDBACK_TOKEN)")
    source = imp.add_mutually_exclusive_group(required=True)
    source.add_argument("--jsonl", help="edge cases, one JSON object a line")
    source.add_argument("--eval-results", help="results JSON written by `posttrain eval ... -o FILE`")
    imp.set_defaults(func=_import)


def export_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain feedback export",
        description="Export the vote log as preference pairs (preferences.jsonl, for `posttrain dpo`), SFT examples "
        "(sft.jsonl) and feedback records (feedback.jsonl, for `posttrain feedback --config …`), each with lineage, "
        "plus manifest.json. Each annotator's latest vote per pair counts; a pair is exported when one response "
        "has strictly more votes than every other choice (tie, both bad and split votes are not exported). The "
        "same log exports to the same bytes.",
    )  # fmt: skip
    parser.add_argument("--db", default=_db_default(), help=DB_HELP)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--min-votes", type=int, default=1, help="annotators a pair needs to be exported (default 1)")
    parser.add_argument("--until", help="read the log up to this vote id or ISO time (inclusive), for a fixed snapshot")
    return parser


def run_export(argv: list[str]) -> int:
    args = export_parser().parse_args(argv)
    from posttrain.serve.db import open_db
    from posttrain.serve.export import export_feedback

    db = open_db(args.db)
    try:
        manifest = export_feedback(db, args.out, min_votes=args.min_votes, until=args.until)
    finally:
        db.close()
    skipped = ", ".join(f"{k} {v}" for k, v in manifest["skipped"].items()) or "none"
    print(f"read {manifest['vote_log']['votes']} votes on {manifest['counts']['pairs_with_votes']} pairs; exported "
          f"{manifest['counts']['exported']} (skipped: {skipped}) → {args.out}/preferences.jsonl, sft.jsonl, feedback.jsonl")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from posttrain.serve.app import create_app
    from posttrain.serve.db import open_db
    from posttrain.serve.models import Limits
    from posttrain.serve.pages import secret_from_file

    if bool(args.guidelines) != bool(args.guidelines_version):
        print("posttrain serve feedback: give --guidelines FILE and --guidelines-version V together", file=sys.stderr)
        return 2
    db = open_db(args.db)
    if args.guidelines:
        with open(args.guidelines, encoding="utf-8") as handle:
            db.put_guideline(args.guidelines_version, handle.read())
    limits = Limits(max_body_bytes=args.max_body_bytes, max_bulk_bytes=args.max_bulk_bytes,
                    max_text_chars=args.max_text_chars, max_json_chars=args.max_json_chars, rate=args.rate,
                    burst=args.burst)  # fmt: skip
    secret = secret_from_file(args.session_secret_file) if args.session_secret_file else None
    app = create_app(db, limits, guideline_version=args.guidelines_version, secure_cookies=args.secure_cookies,
                     session_secret=secret)  # fmt: skip
    print(f"feedback service on http://{args.host}:{args.port} (store {db.backend.name}, schema v{db.schema_version()}); "
          f"annotate at /annotate, admin at /admin")
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


def _user_add(args: argparse.Namespace) -> int:
    from posttrain.serve.db import FeedbackDBError, open_db

    db = open_db(args.db)
    try:
        token = db.create_user(args.name, args.role)
    except FeedbackDBError as exc:
        print(f"posttrain serve user add: {exc}", file=sys.stderr)
        return 2
    finally:
        db.close()
    print(token)
    print(f"created {args.role} {args.name!r}; the token above is shown once (stored hashed)", file=sys.stderr)
    return 0


def _import(args: argparse.Namespace) -> int:
    from posttrain.serve.importer import import_lines, read_source

    if not args.token:
        print("posttrain serve import: give --token (or set POSTTRAIN_FEEDBACK_TOKEN)", file=sys.stderr)
        return 2
    lines = read_source(args.jsonl, args.eval_results)
    result = import_lines(args.server, args.token, lines)
    for error in result["errors"][:20]:
        print(f"line {error['line']}: {error['error']}", file=sys.stderr)
    print(json.dumps({k: v for k, v in result.items() if k != "errors"}))
    return 0 if not result["rejected"] else 2
