"""Curation reads every record source the data layer reads, and builds stages through a registry."""

from __future__ import annotations

import gzip
import importlib
import json
import subprocess
import sys

import pytest

from posttrain.algorithms.registry import UnknownNameError
from posttrain.cli import main
from posttrain.curate.pipeline import curate
from posttrain.curate.registry import CURATION_STAGES
from posttrain.curate.stages import STAGE_MODULES, STAGE_ORDER, build_stage

from .conftest import make_config, pair, read_jsonl, write_jsonl


@pytest.fixture(scope="module")
def pool_rows() -> list[dict]:
    from posttrain.tasks.pool import raw_pool

    return list(raw_pool(60, seed=5))


def _flat(row: dict) -> dict:
    # Parquet wants one type per column; free-form meta travels as JSON text, which the data layer decodes.
    return {**row, "meta": json.dumps(row["meta"])}


def write_source(layout: str, root, rows: list[dict]) -> tuple[str, list[int]]:
    """``rows`` written as ``layout``; returns the path and the line (or row) number of each record."""
    if layout == "jsonl.gz":
        path = root / "in.jsonl.gz"
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
        return str(path), list(range(1, len(rows) + 1))
    if layout == "json_lines":
        return str(write_jsonl(root / "in.json", rows)), list(range(1, len(rows) + 1))
    if layout == "json_array":
        path = root / "in.json"
        path.write_text("[\n" + ",\n".join(json.dumps(row) for row in rows) + "\n]\n", encoding="utf-8")
        return str(path), list(range(2, len(rows) + 2))  # element k starts on line k + 1
    if layout == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([_flat(row) for row in rows]), root / "in.parquet")
        return str(root / "in.parquet"), list(range(1, len(rows) + 1))
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([_flat(row) for row in rows]).save_to_disk(str(root / "saved"))
    return str(root / "saved"), list(range(1, len(rows) + 1))


def _kept(out) -> list[tuple]:
    records = read_jsonl(out / "kept.jsonl")
    return [(r["id"], r["messages"], r["tier"], {k: v for k, v in r["meta"].items() if k != "curate"},
             r["meta"]["curate"]["line"]) for r in records]  # fmt: skip


@pytest.mark.parametrize("layout", ["jsonl.gz", "json_lines", "json_array", "parquet", "dataset"])
def test_every_record_source_curates_like_jsonl(tmp_path, pool_rows, layout):
    reference = curate(make_config(write_jsonl(tmp_path / "in.jsonl", pool_rows), tmp_path / "ref",
                                   "executor.shard_size=7"))  # fmt: skip
    source, lines = write_source(layout, tmp_path, pool_rows)
    manifest = curate(make_config(source, tmp_path / "out", "executor.shard_size=7"))
    assert manifest["funnel"] == reference["funnel"] and manifest["funnel"]["kept"] > 0
    expected = [(*record[:4], lines[record[4] - 1]) for record in _kept(tmp_path / "ref")]
    assert _kept(tmp_path / "out") == expected
    dropped = read_jsonl(tmp_path / "out" / "dropped.jsonl")
    assert {r["source"] for r in dropped} == {source} and {r["line"] for r in dropped} <= set(lines)
    assert manifest["parents"][0]["sha256"]


def test_bad_lines_of_a_compressed_file_keep_their_reason_and_line(tmp_path):
    good = json.dumps({"prompt": "Name a colour of the clear daytime sky.", "response": "Blue."}).encode()
    path = tmp_path / "in.jsonl.gz"
    path.write_bytes(gzip.compress(b"\n".join([good, b"caf\xe9 {", b"", b"[1]", good + b" "]) + b"\n"))
    manifest = curate(make_config(path, tmp_path / "out", "intent.enabled=false", "judge.enabled=false"))
    parse = manifest["funnel"]["stages"][0]
    assert parse["dropped"] == {"invalid_utf8": 1, "blank_line": 1, "unknown_format": 1}
    dropped = {r["line"]: r["reason"] for r in read_jsonl(tmp_path / "out" / "dropped.jsonl")}
    assert dropped == {2: "invalid_utf8", 3: "blank_line", 4: "unknown_format", 5: "exact_duplicate"}


def test_a_json_array_element_that_is_not_an_object_is_dropped_at_its_line(tmp_path):
    path = tmp_path / "in.json"
    path.write_text('[\n  {"instruction": "Name a planet of the solar system.", "output": "Mars"},\n  3\n]\n')
    curate(make_config(path, tmp_path / "out", "intent.enabled=false", "judge.enabled=false"))
    assert [(r["line"], r["reason"]) for r in read_jsonl(tmp_path / "out" / "dropped.jsonl")] == [(3, "unknown_format")]
    assert [r["meta"]["curate"]["line"] for r in read_jsonl(tmp_path / "out" / "kept.jsonl")] == [2]


def test_records_of_other_recipes_are_dropped_with_how_to_convert(tmp_path):
    rows = [{"prompt": "What is two plus two?", "answer": "4"},
            {"prompt": "What is two plus two?", "chosen": "4", "rejected": "5"},
            {"chosen": "\n\nHuman: What is two plus two?\n\nAssistant: 4",
             "rejected": "\n\nHuman: What is two plus two?\n\nAssistant: 5"}]  # fmt: skip
    manifest = curate(make_config(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out"))
    assert manifest["funnel"]["stages"][0]["dropped"] == {"missing_response": 1, "wrong_kind": 2}
    details = [r["detail"] for r in read_jsonl(tmp_path / "out" / "dropped.jsonl")]
    assert "RL prompt" in details[0] and "drop `rejected`" in details[1] and "HH-RLHF" in details[2]


def test_unsupported_and_missing_inputs_are_clear_errors(tmp_path, capsys):
    (tmp_path / "raw.txt").write_text("hello\n")
    assert main(["curate", f"data.input={tmp_path / 'raw.txt'}", f"output_dir={tmp_path / 'o'}"]) == 2
    assert "unsupported file type '.txt'" in capsys.readouterr().err
    assert main(["curate", f"data.input={tmp_path / 'gone'}", f"output_dir={tmp_path / 'o'}"]) == 2
    assert "input file not found" in capsys.readouterr().err


# -- the stage registry ----------------------------------------------------------------------------------


def test_every_stage_registers_itself_once_in_its_module():
    for module in set(STAGE_MODULES.values()):
        importlib.import_module(module)
    assert CURATION_STAGES.names() == sorted(STAGE_ORDER)
    for name in STAGE_ORDER:
        assert CURATION_STAGES.get(name).__module__ == STAGE_MODULES[name]


def test_a_duplicate_stage_name_is_rejected():
    importlib.import_module(STAGE_MODULES["filters"])
    with pytest.raises(ValueError, match="'filters' is already registered"):
        CURATION_STAGES.add("filters", lambda recipe, cache_dir: None)


def test_build_stage_names_the_nearest_stage(tmp_path):
    config = make_config(tmp_path / "in.jsonl", tmp_path / "out")
    assert build_stage("filters", config).name == "filters"
    with pytest.raises(UnknownNameError, match="did you mean 'filters'"):
        build_stage("filter", config)


def test_a_worker_imports_only_the_stages_it_runs(tmp_path):
    script = f"""
import sys
from posttrain.config import load_config
from posttrain.curate.config import CurateRecipe
from posttrain.curate.stages import build_stage
config = load_config(CurateRecipe, None, ["data.input=x.jsonl", "output_dir={tmp_path}"])
build_stage("filters", config)
loaded = [m for m in ("posttrain.curate.difficulty", "posttrain.curate.judge", "posttrain.curate.intent", "torch")
          if m in sys.modules]
print(",".join(loaded) or "none")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "none"


def test_curating_a_local_jsonl_file_never_imports_fsspec(tmp_path):
    # fsspec (with asyncio) is 0.07 s of start-up a local run does not need: the data layer takes plain local paths
    # through the standard library (posttrain.data.storage.is_plain_local) and imports fsspec for URLs only. (The
    # model stages are off: they import torch, which imports asyncio.)
    data = write_jsonl(tmp_path / "raw.jsonl", [pair(f"Question {i}?", f"Answer number {i}.") for i in range(20)])
    probe = ("import sys; from posttrain.cli import main; from posttrain.curate.stages import STAGE_ORDER; "
             f"code = main(['curate', '--config', 'curate', 'data.input={data}', 'output_dir={tmp_path / 'out'}', "
             "'executor.workers=0', 'progress=false', *[f'{stage}.enabled=false' for stage in STAGE_ORDER "
             "if stage not in ('normalize', 'filters', 'exact_dedup', 'near_dedup')]]); "
             "print(code, sorted(m for m in sys.modules if m.split('.')[0] in ('fsspec', 'asyncio')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout.strip().splitlines()[-1] == "0 []", out.stdout[-2000:]
