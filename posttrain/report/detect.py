"""What kind of run a path holds, told from the files posttrain commands write into it."""

from __future__ import annotations

from pathlib import Path

from posttrain.report.collect import is_comparison, is_comparison_set, is_eval_results, read_json

KINDS = ("flywheel", "training", "curate", "eval")


class NotARunDirectory(ValueError):
    """The path holds none of the files a report is drawn from."""


def _is_json_of_eval(path: Path) -> bool:
    try:
        data = read_json(path)
    except (ValueError, UnicodeDecodeError):
        return False
    return is_eval_results(data) or is_comparison(data) or is_comparison_set(data)


def detect(path: Path) -> str:
    """One of ``KINDS``:

    - ``flywheel``: ``rounds.json``, or stage directories with ``stage.json`` (``posttrain flywheel``);
    - ``training``: ``metrics.jsonl`` (sft, pretrain, dpo family, rm, grpo: ``posttrain.train.runner``);
    - ``curate``: ``funnel.json`` (``posttrain curate`` and ``posttrain sample`` output directories);
    - ``eval``: a ``posttrain eval -o`` results file, an ``eval compare -o`` file or a flywheel's
      ``comparisons.json``, or a directory of them.
    """
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if path.is_file():
        if _is_json_of_eval(path):
            return "eval"
        raise NotARunDirectory(f"{path}: not a `posttrain eval` results or comparison file (a JSON object with "
                               "`items` and `scores`, or `composite` and `summary`)")
    if (path / "rounds.json").is_file() or any(path.glob("*/stage.json")):
        return "flywheel"
    if (path / "metrics.jsonl").is_file():
        return "training"
    if (path / "funnel.json").is_file():
        return "curate"
    if any(_is_json_of_eval(p) for p in path.glob("*.json")):
        return "eval"
    raise NotARunDirectory(
        f"{path}: not a run directory posttrain can report on: it holds no stage.json stages (flywheel), "
        "metrics.jsonl (training run), funnel.json (curate / sample output) or eval results JSON"
    )
