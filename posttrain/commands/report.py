"""``posttrain report PATH``: the self-contained HTML report of any run directory or eval results file."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report",
        help="Draw the self-contained HTML report (report.html + report.json) of a run directory or eval results.",
        description=(
            "Tells from its files what RUN_DIR is and draws its report, plotly inlined (opens offline):\n"
            "  flywheel run      (stage directories with stage.json; rounds.json for several rounds)\n"
            "  training run      (metrics.jsonl: sft, pretrain, dpo family, rm, grpo output_dir)\n"
            "  curate / sample   (funnel.json, manifest.json)\n"
            "  eval results      (a `posttrain eval -o` file, `eval compare -o` file, or a directory of them)\n"
            "RUN_DIR may be a run in object storage (s3://bucket/run): its metrics, alerts, config and results\n"
            "are fetched (not its checkpoints) and the report is written to ./<run name>.report.html.\n"
            "Anything else exits 2 with one line saying what was looked for."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", metavar="RUN_DIR", help="run directory (local or s3://…), or an eval results / "
                        "comparison JSON file")
    parser.add_argument("--out", metavar="FILE", help="HTML file to write (default: RUN_DIR/report.html, FILE.report.html "
                        "beside a results file, ./<run name>.report.html for a remote run); the numbers go beside it "
                        "as .json")
    parser.set_defaults(func=_report)


def _report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from posttrain.report import write_report

    written = write_report(args.path, Path(args.out) if args.out else None)  # a str: Path() would break s3://
    print(f"{written['kind']} report: {written['html']} ({written['charts']} charts)\nnumbers: {written['json']}")
    return 0
