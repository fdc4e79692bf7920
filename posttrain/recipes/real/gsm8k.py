"""GSM8K as posttrain RL prompts: ``python -m posttrain.recipes.real.gsm8k IN OUT``.

IN is a file of the hub's ``openai/gsm8k`` rows (``question``, and ``answer``: the worked solution ending in
``#### 72``), as ``hf download openai/gsm8k --repo-type dataset`` fetches them (``main/train-*.parquet``) or any
JSONL of the same rows. OUT is JSONL of RL prompts for ``posttrain grpo``: the question plus verl's instruction
(``examples/data_preprocess/gsm8k.py``: "Let's think step by step and output the final answer after \\"####\\"."),
the number after ``####`` as ``answer`` (thousands commas dropped), checked by the ``numeric`` verifier (the number
after the last "answer:", else the last number in the completion), the worked solution kept in ``meta``, and an
``id`` (``gsm8k-test-17``: split and row), so the same file is also an eval suite (``posttrain eval --suite``).
A row without a ``#### number`` answer stops the conversion naming its row.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from posttrain.data.formats import BLANK_LINE
from posttrain.data.io import BadLine, iter_raw_records, write_jsonl

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_FINAL = re.compile(r"####\s*(?P<answer>[-+]?[\d,]*\.?\d+)\s*$")


def to_rl_prompt(row: dict, line: int, source: str) -> dict:
    """One GSM8K row as an RL prompt record (``id``, ``prompt``, ``answer``, ``verifier``, ``group``, ``meta``)."""
    question, solution = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not isinstance(solution, str):
        raise ValueError(f"{source}:{line}: a GSM8K row needs `question` and `answer` strings (got keys {sorted(row)})")
    match = _FINAL.search(solution.strip())
    if match is None:
        raise ValueError(f"{source}:{line}: `answer` does not end in `#### <number>`: {solution[-80:]!r}")
    split = Path(source).name.split("-")[0].split(".")[0]  # "train" of train-00000-of-00001.parquet
    return {"id": f"gsm8k-{split}-{line}", "prompt": f"{question.strip()} {INSTRUCTION}",
            "answer": match["answer"].replace(",", ""),
            "verifier": "numeric", "group": "math", "meta": {"source": "openai/gsm8k", "solution": solution}}


def convert(source: str, target: str) -> int:
    """Write ``source``'s GSM8K rows to ``target`` as RL prompts; return how many."""
    rows = []
    for line, row in iter_raw_records(source):
        if isinstance(row, BadLine):
            if row.category == BLANK_LINE:
                continue
            raise ValueError(f"{source}:{line}: {row.reason}")
        rows.append(to_rl_prompt(row, line, source))
    return write_jsonl(target, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posttrain.recipes.real.gsm8k", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="openai/gsm8k rows: main/train-00000-of-00001.parquet, or JSONL")
    parser.add_argument("target", help="where the RL prompts go (.jsonl)")
    args = parser.parse_args(argv)
    try:
        count = convert(args.source, args.target)
    except (ValueError, FileNotFoundError) as exc:
        print(f"gsm8k: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {count} GSM8K prompts to {args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
