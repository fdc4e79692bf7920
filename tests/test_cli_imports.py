"""First contact is fast: ``--help``, ``--version``, every subcommand's ``--help`` and ``validate`` on a
packaged recipe must not import torch, transformers or the other heavy libraries.

This is a deterministic check of ``sys.modules`` in a fresh interpreter, not a timed test (the timing
is ``benchmarks/cli_startup.py``). One subprocess runs every command in turn and records which heavy
modules each one added (modules stay loaded, so each is charged to the first command that loaded it): a
failure names the command that pulled a module in and the module itself.
"""

from __future__ import annotations

import json
import subprocess
import sys

# Imported only by the work itself. numpy is here too: nothing on the parse / help / validate path needs it.
HEAVY = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "datasets", "pyarrow", "fsspec", "ray",
         "tqdm")

COMMANDS = [
    ["--help"],
    ["--version"],
    ["validate", "--help"],
    ["validate", "--quiet", "--config", "sft_tiny"],
    ["validate", "--quiet", "--config", "quickstart"],
    ["recipes", "--help"],
    ["recipes", "list"],
    ["data", "--help"],
    ["data", "inspect", "--help"],
    ["model", "--help"],
    ["model", "tiny", "--help"],
    ["quickstart", "--help"],
    ["generate", "--help"],
    ["eval", "--help"],
    ["eval", "compare", "--help"],
]

PROBE = """
import contextlib, io, json, sys
HEAVY = set({heavy!r})


def heavy_loaded():
    return {{m.split(".")[0] for m in sys.modules}} & HEAVY


report, seen = [], heavy_loaded()  # before posttrain is imported: nothing heavy (checked by the test)
report.append({{"argv": ["(interpreter start)"], "code": 0, "heavy": sorted(seen), "stderr": ""}})
from posttrain.cli import build_parser, main

recipes = list(build_parser()._subparsers._group_actions[0].choices)
report.append({{"argv": ["(import posttrain.cli, build the parser)"], "code": 0,
                "heavy": sorted(heavy_loaded() - seen), "stderr": ""}})
seen |= heavy_loaded()
for argv in {commands!r} + [[name, "--help"] for name in recipes]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    report.append({{"argv": argv, "code": code, "heavy": sorted(heavy_loaded() - seen), "stderr": err.getvalue()[-500:]}})
    seen |= heavy_loaded()
print(json.dumps(report))
"""


def _report(commands: list[list[str]], cwd) -> list[dict]:
    probe = PROBE.format(heavy=HEAVY, commands=commands)
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_help_version_and_validate_import_no_heavy_library(tmp_path):
    # From another directory: packaged recipes must resolve by name, not through the repository checkout.
    report = _report(COMMANDS, tmp_path)
    ran = {" ".join(entry["argv"]) for entry in report}
    assert {"sft --help", "dpo --help", "flywheel --help", "curate --help"} <= ran  # the recipe commands ran too
    failed = [entry for entry in report if entry["code"] not in (0, None)]
    assert not failed, failed
    heavy = {" ".join(entry["argv"]): entry["heavy"] for entry in report if entry["heavy"]}
    assert not heavy, f"these commands imported heavy modules: {heavy}"


def test_validate_of_a_dpo_recipe_imports_no_heavy_library(tmp_path):
    argv = ["validate", "--quiet", "--config", "dpo_tiny"]
    entry = next(entry for entry in _report([argv], tmp_path) if entry["argv"] == argv)
    assert entry["code"] == 0, entry
    assert not entry["heavy"], entry["heavy"]
