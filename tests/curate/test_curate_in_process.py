"""Shortcuts ``posttrain curate`` takes, none of which may change a byte of what it writes: in this process
(``executor.workers: 0``) the rows the segments hand on stay in memory within a budget (``stages.Handoff``); a plain
input is cut into shards a block at a time (``pipeline._cut_plain``); a line without a backslash skips the escape
check of its id (``rows.parse_line``); and the command ends without interpreter teardown
(``exit_process(code, teardown=False)``, which ``posttrain curate`` gets from ``__main__``)."""

from __future__ import annotations

import json
import os
import pickle
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.cli import main
from posttrain.curate import pipeline, stages
from posttrain.curate.pipeline import _cut, _cut_plain, curate
from posttrain.curate.rows import Row, parse_line
from posttrain.curate.stages import load_rows, save_rows
from posttrain.data.formats import FormatError, convert

from .conftest import make_config

OUTPUTS = ("kept.jsonl", "dropped.jsonl", "funnel.json")


def _run(raw_pool_file: Path, out: Path, monkeypatch, budget: int | None) -> tuple[dict, list[bool]]:
    """Curate the noisy pool in 4 shards with a ``Handoff`` of ``budget`` bytes (None: the default); returns the
    manifest and what each ``hold`` answered."""
    answers: list[bool] = []
    hold = stages.Handoff.hold

    def spy(self, key, value, size):
        answers.append(hold(self, key, value, size))
        return answers[-1]

    with monkeypatch.context() as patch:
        patch.setattr(stages.Handoff, "hold", spy)
        patch.setattr(pipeline, "Handoff", stages.Handoff if budget is None else lambda: stages.Handoff(budget))
        manifest = curate(make_config(raw_pool_file, out, "executor.shard_size=64"))
    return manifest, answers


def test_rows_held_in_memory_give_the_bytes_spilled_rows_give(raw_pool_file, tmp_path, monkeypatch):
    spilled, never = _run(raw_pool_file, tmp_path / "spilled", monkeypatch, budget=0)
    held, always = _run(raw_pool_file, tmp_path / "held", monkeypatch, budget=None)
    mixed, some = _run(raw_pool_file, tmp_path / "mixed", monkeypatch, budget=150_000)
    assert never and not any(never) and always and all(always) and any(some) and not all(some)
    for name in OUTPUTS:
        assert (tmp_path / "held" / name).read_bytes() == (tmp_path / "spilled" / name).read_bytes(), name
        assert (tmp_path / "mixed" / name).read_bytes() == (tmp_path / "spilled" / name).read_bytes(), name
    assert held["dataset_id"] == spilled["dataset_id"] == mixed["dataset_id"]
    assert not list((tmp_path / "held").glob(".work*"))  # the scratch directory is gone either way


def test_process_pool_tasks_carry_no_handoff(raw_pool_file, tmp_path, monkeypatch):
    """A pool's workers are other processes: what they hand on must go through files."""
    seen = []
    run_tasks = pipeline.run_tasks

    def spy(fn, tasks, config, *args, **kwargs):
        seen.extend(task.handoff for task in tasks)
        return run_tasks(fn, tasks, config, *args, **kwargs)

    monkeypatch.setattr(pipeline, "run_tasks", spy)
    curate(make_config(raw_pool_file, tmp_path / "pool", "executor.shard_size=64", "executor.workers=2"))
    assert seen and all(handoff is None for handoff in seen)


def test_handoff_holds_within_its_budget_and_gives_each_value_back_once():
    handoff = stages.Handoff(budget=10)
    assert handoff.hold("a", ["rows of a"], 6)
    assert not handoff.hold("b", ["rows of b"], 5) and handoff.held == 6  # over budget: b goes to its file
    assert handoff.take("a") == ["rows of a"] and handoff.held == 0
    assert handoff.take("a") is None and handoff.take("b") is None
    assert handoff.hold("b", [], 5) and handoff.take("b") == []  # an empty shard is held too, and told apart


def test_rows_spill_to_their_file_when_the_handoff_is_full(tmp_path):
    rows = [Row(0, "in.jsonl", 1, "r0", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])]
    full = stages.Handoff(budget=stages.rows_bytes(rows) - 1)
    stages.save_rows(rows, tmp_path / "rows.pkl", full)
    assert (tmp_path / "rows.pkl").exists() and full.held == 0
    assert stages.load_rows(tmp_path / "rows.pkl", full) == rows
    roomy = stages.Handoff()
    stages.save_rows(rows, tmp_path / "held.pkl", roomy)
    assert not (tmp_path / "held.pkl").exists() and stages.load_rows(tmp_path / "held.pkl", roomy) is rows


def _line_by_line(path: Path):
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            yield number, len(line)


@settings(max_examples=150, deadline=None)
@given(data=st.lists(st.sampled_from([b"{}", b"x", b"", b"\r", b"abcdef"]), max_size=30).map(b"\n".join),
       trailing=st.booleans(), shard_size=st.integers(1, 8), block_size=st.sampled_from([1, 2, 3, 7, 1 << 20]))
def test_a_plain_file_is_cut_as_line_by_line_reading_cuts_it(tmp_path_factory, data, trailing, shard_size, block_size):
    path = tmp_path_factory.mktemp("cut") / "in.jsonl"
    path.write_bytes(data + b"\n" * trailing)
    expected = _cut(str(path), str(path), _line_by_line(path), shard_size, 11)
    assert _cut_plain(str(path), shard_size, 11, block_size) == expected


_TEXT = st.text(st.sampled_from(list('ab \t\n\x00\x7f"\\/éß漢\u2028') + ["\U0001f600"]), max_size=8)


@settings(max_examples=300, deadline=None)
@given(prompt=_TEXT, response=_TEXT, ensure_ascii=st.booleans())
def test_a_line_with_or_without_a_backslash_gets_the_id_convert_gives(prompt, response, ensure_ascii):
    line = json.dumps({"prompt": prompt, "response": response}, ensure_ascii=ensure_ascii).encode()
    parsed = parse_line(line, 0, "in.jsonl", 1)
    try:
        record, _ = convert(json.loads(line), "auto", kind="sft")
    except FormatError:  # a blank text: parse_line must refuse it too
        record = None
    if record is None:
        assert not isinstance(parsed, Row)
    else:
        assert isinstance(parsed, Row) and parsed.id == record.id


# -- leaving without interpreter teardown ----------------------------------------------------------------------
_EXIT_SCRIPT = """
import os, sys, threading, time
from posttrain.exit_codes import exit_process

class Freed:
    def __del__(self):
        os.write(1, b" [teardown]")

alive = Freed()  # a module global: freed by interpreter teardown, and only by it
if "thread" in sys.argv:  # a thread the interpreter waits for at exit: the process must wait too
    threading.Thread(target=lambda: (time.sleep(0.3), os.write(1, b" [thread]"))).start()
import atexit
atexit.register(lambda: print(" [atexit]", end=""))
print("written, not flushed", end="")
exit_process(3, teardown="skip" not in sys.argv)
"""


@pytest.mark.parametrize(("args", "markers"), [
    ([], {"[atexit]", "[teardown]"}),
    (["skip"], {"[atexit]"}),
    (["skip", "thread"], {"[thread]", "[atexit]", "[teardown]"}),  # the usual exit, which waits for the thread
])  # fmt: skip
def test_leaving_without_teardown_flushes_runs_exit_handlers_and_keeps_the_code(args, markers):
    done = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, *args], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (3, "")
    assert "written, not flushed" in done.stdout
    assert set(done.stdout.replace("written, not flushed", "").split()) == markers


def test_the_curate_command_leaves_early_with_every_output_written(raw_pool_file, tmp_path, capsys):
    """``posttrain curate`` as a process (teardown skipped) and as a call in this one write the same bytes."""
    out = tmp_path / "out"
    args = ["curate", "--config", "curate", f"data.input={raw_pool_file}", f"output_dir={out}",
            "intent.method=judge", "executor.workers=0", "progress=false"]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    written = {name: (out / name).read_bytes() for name in (*OUTPUTS, "manifest.json")}
    done = subprocess.run([sys.executable, "-m", "posttrain", *args], capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout) == (0, printed)
    assert {name: (out / name).read_bytes() for name in written} == written
    assert json.loads(written["manifest.json"])["funnel"]["input"] == 244
    missing = subprocess.run([sys.executable, "-m", "posttrain", "curate", f"data.input={tmp_path / 'none.jsonl'}",
                              f"output_dir={tmp_path / 'o'}"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert missing.returncode == 2 and "input file not found" in missing.stderr


# -- the scratch rows' loader ----------------------------------------------------------------------------------
class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo planted",))


def test_scratch_rows_load_as_saved_and_a_pickle_naming_a_callable_is_refused(tmp_path):
    rows = [Row(3, "in.jsonl", 4, "sft-x", [{"role": "user", "content": "é"}, {"role": "assistant", "content": "b"}],
                {"nested": [1, 2.5, None, True]}, scores={"near_dup_cluster": "c1"}, tier=2)]  # fmt: skip
    save_rows(rows, tmp_path / "rows.pkl")
    assert load_rows(tmp_path / "rows.pkl") == rows
    (tmp_path / "planted.pkl").write_bytes(pickle.dumps([_RunsCode()]))
    with pytest.raises(pickle.UnpicklingError, match="refusing posix.system"):
        load_rows(tmp_path / "planted.pkl")


def test_the_scratch_directory_is_private_while_the_run_lasts(raw_pool_file, tmp_path, monkeypatch):
    seen = []
    real = stages.save_rows

    def spy(rows, path, handoff=None):
        seen.append(stat.S_IMODE(os.stat(Path(path).parent).st_mode))
        return real(rows, path, handoff)

    monkeypatch.setattr(stages, "save_rows", spy)
    _run(raw_pool_file, tmp_path / "out", monkeypatch, budget=0)
    assert seen and set(seen) == {0o700}
    assert not list((tmp_path / "out").glob(".work*"))
