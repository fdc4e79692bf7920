"""``posttrain demo``: what ``make demo`` runs — the embedded default, offline, on a laptop CPU.

Until the full quickstart flywheel lands, the demo builds the tiny model and the built-in sample
dataset, inspects the data, and fine-tunes the model on it for a few steps with the tiered
curriculum, so every layer (config, data, tokenisation, training, checkpoint, export) runs for real.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="Run the embedded default (what `make demo` runs): tiny model + built-in data, offline."
    )
    parser.add_argument("--run-dir", default="runs/demo", help="where the demo writes its files")
    parser.add_argument("--steps", type=int, default=30, help="SFT steps")
    parser.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from posttrain.cli import main as cli_main
    from posttrain.data.io import write_records
    from posttrain.data.samples import sample_sft_records
    from posttrain.models.tiny import build_tiny_model

    run_dir = Path(args.run_dir)
    records = sample_sft_records(n=128, seed=0)
    data = run_dir / "data" / "sample_sft.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    write_records(data, records)
    texts = [m.content for r in records for m in r.messages]
    model = build_tiny_model(run_dir / "base-model", texts=texts, vocab_size=512, seed=0)
    print(f"\n== built-in sample data: {data}\n", flush=True)
    code = cli_main(["data", "inspect", str(data), "--model", str(model), "--max-length", "128"])
    if code:
        return code
    print("\n== SFT with the tiered curriculum\n", flush=True)
    code = cli_main([
        "sft", "--config", str(Path(__file__).resolve().parents[2] / "recipes" / "sft_tiny.yaml"),
        f"model.path={model}", f"data.train={data}", f"output_dir={run_dir / 'sft'}", f"train.max_steps={args.steps}",
    ])
    if code == 0:
        print(f"\nfine-tuned model: {run_dir / 'sft' / 'final'}; metrics: {run_dir / 'sft' / 'metrics.jsonl'}", file=sys.stderr)
    return code
