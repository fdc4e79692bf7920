"""Hostile config and data files end in one line and exit 2, never in MemoryError or RecursionError.

A 1 KB YAML of nested aliases names a billion values; a YAML nested 20,000 deep overflows PyYAML's recursive
composer; a data file with one multi-gigabyte line used to be read whole. Each case is driven through the
real reader (the CLI where that is cheap) and would crash the process on a reader without the bounds.
"""

from __future__ import annotations

import gzip
import json
import resource
import subprocess
import sys
import tracemalloc

import pytest
import yaml

from posttrain.cli import main
from posttrain.config import ConfigError, load_config, parse_overrides
from posttrain.config.recipes import SFTRecipe
from posttrain.data.errors import DataError
from posttrain.data.io import iter_raw_records, read_records

CHAT = {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]}
MiB = 2**20
MAX_YAML_NODES, MAX_YAML_DEPTH = 100_000, 200  # the documented bounds (posttrain.config.loader)


def laughs(levels: int = 9, width: int = 10) -> list[str]:
    """``a0: &a0 [lol × width]``, then each level ``width`` aliases of the one before: width**levels values."""
    entries = [f"a0: &a0 [{', '.join(['lol'] * width)}]"]
    for level in range(1, levels):
        entries.append(f"a{level}: &a{level} [{', '.join([f'*a{level - 1}'] * width)}]")
    return entries


def billion_laughs() -> str:
    return "recipe: sft\n" + "\n".join(laughs()) + "\n"


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    problems = [line for line in err.splitlines() if line and line != "posttrain: invalid config"]
    assert len(problems) == 1, err
    return problems[0]


def _limit_memory() -> None:
    # A reader that expands the aliases would take all the machine's memory before failing; 2 GiB makes it
    # fail (exit 1, MemoryError) in seconds instead.
    resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))


# ------------------------------------------------------------------------------------------ YAML


def test_billion_laughs_config_exits_2_with_one_line_naming_the_file(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(billion_laughs())
    assert bomb.stat().st_size < 1024
    done = subprocess.run([sys.executable, "-m", "posttrain", "validate", "--config", str(bomb)], capture_output=True,
                          text=True, timeout=120, preexec_fn=_limit_memory)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    problem = done.stderr.splitlines()[-1]
    assert str(bomb) in problem and f"more than {MAX_YAML_NODES}" in problem and "alias" in problem


def test_an_alias_bomb_in_a_command_line_override_is_refused():
    with pytest.raises(ConfigError, match=rf"command line `debug.nan_steps=.*more than {MAX_YAML_NODES} values"):
        parse_overrides(["debug.nan_steps={" + ", ".join(laughs()) + "}"])


def test_a_recursive_alias_is_refused():
    from posttrain.config.loader import load_yaml

    with pytest.raises(ConfigError, match=r"cfg.yaml:2: .*refers to a value that contains it"):
        load_yaml("recipe: sft\nloop: &loop [1, *loop]\n", "cfg.yaml")


def test_yaml_nested_20000_deep_exits_2_with_one_line(tmp_path, capsys):
    deep = tmp_path / "deep.yaml"
    deep.write_text("recipe: sft\nx: " + "[" * 20_000 + "]" * 20_000 + "\n")
    assert main(["validate", "--config", str(deep)]) == 2
    problem = one_line_error(capsys)
    assert str(deep) in problem and f"nested more than {MAX_YAML_DEPTH} levels deep" in problem


def test_nesting_through_a_chain_of_aliases_counts_too():
    from posttrain.config.loader import load_yaml

    # Each level is one short line, so no single collection is deep; the value built from it is.
    chain = ["l0: &l0 [x]"] + [f"l{i}: &l{i} [*l{i - 1}]" for i in range(1, MAX_YAML_DEPTH + 10)]
    with pytest.raises(ConfigError, match=f"nested more than {MAX_YAML_DEPTH} levels deep"):
        load_yaml("\n".join(chain), "chain.yaml")


def test_a_config_over_10_mib_is_refused_before_parsing(tmp_path):
    from posttrain.config.loader import read_yaml

    big = tmp_path / "big.yaml"
    big.write_text("recipe: sft\n" + "# padding\n" * (11 * MiB // 10))
    with pytest.raises(ConfigError, match=r"big.yaml: .* bytes, more than the 10485760 bytes a YAML file may have"):
        read_yaml(big)


def test_bounds_leave_ordinary_yaml_alone():
    from posttrain.config.loader import load_yaml

    text = "base: &base {lr: 0.1, betas: [0.9, 0.95]}\nsft: {<<: *base, lr: 0.2}\nrl: *base\n"
    assert load_yaml(text, "ok.yaml") == {"base": {"lr": 0.1, "betas": [0.9, 0.95]},
                                          "sft": {"lr": 0.2, "betas": [0.9, 0.95]},
                                          "rl": {"lr": 0.1, "betas": [0.9, 0.95]}}
    wide = yaml.safe_dump({"items": [{"q": str(i), "a": i} for i in range(MAX_YAML_NODES // 6)]})
    assert len(load_yaml(wide, "wide.yaml")["items"]) == MAX_YAML_NODES // 6


def _deep_yaml(path) -> None:
    path.write_text("name: x\nitems: " + "[" * 20_000 + "]" * 20_000 + "\n")


def test_an_eval_suite_nested_20000_deep_is_a_config_error(tmp_path):
    from posttrain.eval.items import _suite_from_file

    suite = tmp_path / "suite.yaml"
    _deep_yaml(suite)
    with pytest.raises(ConfigError, match="nested more than"):
        _suite_from_file(suite)


def test_a_run_directory_config_nested_20000_deep_is_a_config_error(tmp_path):
    from posttrain.report.collect import training_run

    _deep_yaml(tmp_path / "config.yaml")
    with pytest.raises(ConfigError, match=r"config.yaml:2: YAML nested more than"):
        training_run(tmp_path)


def test_a_prometheus_rules_file_nested_20000_deep_is_a_config_error(tmp_path):
    from posttrain.telemetry.rules import render

    with pytest.raises(ConfigError, match="nested more than"):
        render("groups: " + "[" * 20_000 + "]" * 20_000)


# ------------------------------------------------------------------------------------------ data


def write_gz(path, lines: list[bytes]) -> str:
    with gzip.open(path, "wb", compresslevel=1) as handle:
        for line in lines:
            handle.write(line + b"\n")
    return str(path)


def test_a_record_over_max_record_bytes_is_quarantined_and_never_returned(tmp_path):
    long_text = "x" * (3 * MiB)
    long_line = json.dumps({"messages": [{"role": "user", "content": long_text}, CHAT["messages"][1]]})
    path = write_gz(tmp_path / "train.jsonl.gz", [json.dumps(CHAT).encode(), long_line.encode(),
                                                  json.dumps(CHAT).encode()])
    quarantine = tmp_path / "quarantine.jsonl"
    records, report = read_records(path, kind="sft", on_error="quarantine", quarantine_path=str(quarantine),
                                   max_record_bytes=MiB, progress=False)
    assert len(records) == 2 and report.read == 3 and report.quarantined == 1
    assert all(len(m.content) < 100 for record in records for m in record.messages)
    entry = json.loads(quarantine.read_text())
    assert entry["line"] == 2
    assert entry["reason"] == f"record of more than {MiB} bytes ({len(long_line)} bytes), over data.max_record_bytes"
    assert len(entry["raw"]) < 2048  # only the start of the line, to recognise it by
    # The default (on_error="raise") stops at that line, naming it.
    with pytest.raises(DataError, match=rf"train.jsonl.gz:2: record of more than {MiB} bytes"):
        read_records(path, kind="sft", max_record_bytes=MiB, progress=False)


def test_an_overlong_line_is_skipped_in_chunks_not_held(tmp_path):
    # 64 MiB of one line, 1 MiB allowed: a reader that holds the line peaks above 64 MiB.
    path = tmp_path / "huge.jsonl.gz"
    with gzip.open(path, "wb", compresslevel=1) as handle:
        handle.write(json.dumps(CHAT).encode() + b"\n" + b'{"text": "')
        block = b"y" * MiB
        for _ in range(64):
            handle.write(block)
        handle.write(b'"}\n' + json.dumps(CHAT).encode() + b"\n")
    tracemalloc.start()
    try:
        items = [(line, type(item).__name__) for line, item in iter_raw_records(str(path), max_record_bytes=MiB)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert items == [(1, "dict"), (2, "BadLine"), (3, "dict")]
    assert peak < 8 * MiB, f"peak {peak / MiB:.0f} MiB"


def test_max_record_bytes_is_a_positive_data_setting():
    from posttrain.data.lines import MAX_RECORD_BYTES  # the readers' default, for callers with no config

    assert SFTRecipe.model_fields["data"].default_factory().max_record_bytes == MAX_RECORD_BYTES == 64 * MiB
    base = {"recipe": "sft", "output_dir": "x", "model": {"path": "m"}, "data": {"train": "t.jsonl"}}
    assert load_config(SFTRecipe, data=base, overrides=["data.max_record_bytes=1000"]).data.max_record_bytes == 1000
    with pytest.raises(ConfigError, match="data.max_record_bytes"):
        load_config(SFTRecipe, data=base, overrides=["data.max_record_bytes=0"])


def test_sft_quarantines_a_record_over_data_max_record_bytes(tiny_model_dir, tmp_path, capsys):
    long_chat = {"messages": [{"role": "user", "content": "q" * 5000}, {"role": "assistant", "content": "4"}]}
    data = write_gz(tmp_path / "train.jsonl.gz", [json.dumps(c).encode() for c in [CHAT, long_chat, CHAT, CHAT]])
    argv = ["sft", "--config", "sft_tiny", f"model.path={tiny_model_dir}", f"data.train={data}",
            f"output_dir={tmp_path / 'run'}", "train.max_steps=2", "train.save_every=100", "train.warmup_steps=0",
            "data.curriculum=none", "data.on_error=quarantine", "data.max_record_bytes=4096"]
    assert main(argv) == 0, capsys.readouterr().err
    entry = json.loads((tmp_path / "run" / "quarantine.jsonl").read_text())
    assert entry["line"] == 2 and "over data.max_record_bytes" in entry["reason"]
