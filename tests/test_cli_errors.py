"""Exit codes keep their promise: bad input exits 2 with one line, a bug exits 1 with one line, and only
``posttrain --debug`` prints a traceback."""

from __future__ import annotations

import gzip
import importlib
import json

import pytest

import posttrain.eval.cli
from posttrain.cli import BAD_INPUT_ERRORS, main

CHAT = {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]}


def write_lines(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def sft(tiny_model_dir, tmp_path, data, *extra) -> list[str]:
    return ["sft", "--config", "sft_tiny", f"model.path={tiny_model_dir}", f"data.train={data}",
            f"output_dir={tmp_path / 'run'}", "train.max_steps=2", "train.save_every=100", "train.warmup_steps=0",
            "data.curriculum=none", *extra]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("posttrain")]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def test_rl_prompts_given_to_sft_stop_with_reasons_format_and_how_to_convert(tiny_model_dir, tmp_path, capsys):
    # sft_tiny quarantines by default: every record went to quarantine, then "ValueError: the training set is empty".
    data = write_lines(tmp_path / "prompts.jsonl", [{"prompt": f"What is {i}+1?", "answer": str(i + 1)} for i in range(5)])
    assert main(sft(tiny_model_dir, tmp_path, data)) == 2
    line = one_line_error(capsys)
    assert "the training set is empty: all 5 records read were quarantined" in line
    assert "wrong record kind: 5" in line and "Detected format: rl (5)" in line and "posttrain sample" in line


def test_chat_pairs_given_to_dpo_stop_the_same_way(tiny_model_dir, tmp_path, capsys):
    data = write_lines(tmp_path / "chats.jsonl", [CHAT] * 4)
    argv = ["dpo", "--config", "dpo_tiny", f"model.path={tiny_model_dir}", f"data.train={data}", "data.eval=null",
            f"output_dir={tmp_path / 'run'}", "train.max_steps=2"]
    assert main(argv) == 2
    line = one_line_error(capsys)
    assert "the training set is empty" in line and "Detected format: messages (4)" in line


def test_an_assistant_first_chat_is_quarantined_and_sft_trains_on_the_rest(tiny_model_dir, tmp_path, capsys):
    opener = {"messages": [{"role": "assistant", "content": "Hello!"}, *CHAT["messages"]]}
    data = write_lines(tmp_path / "train.jsonl", [CHAT, opener, CHAT, CHAT])
    assert main(sft(tiny_model_dir, tmp_path, data)) == 0
    entry = json.loads((tmp_path / "run" / "quarantine.jsonl").read_text())
    assert entry["line"] == 2 and "starts with an assistant turn" in entry["reason"]


def test_a_batch_that_does_not_split_is_exit_2(tiny_model_dir, tmp_path, capsys):
    data = write_lines(tmp_path / "train.jsonl", [CHAT] * 8)
    assert main(sft(tiny_model_dir, tmp_path, data, "train.global_batch_size=8", "train.batch_size=3")) == 2
    assert "not a whole number of micro-batches of train.batch_size=3" in one_line_error(capsys)


def test_a_truncated_gz_is_exit_2(tmp_path, capsys):
    whole = gzip.compress(("".join(json.dumps(CHAT) + "\n" for _ in range(300))).encode())
    path = tmp_path / "train.jsonl.gz"
    path.write_bytes(whole[: len(whole) // 2])
    assert main(["data", "inspect", str(path)]) == 2
    assert f"{path}: the gzip-compressed file is truncated or corrupt" in one_line_error(capsys)


def _crashing_compare(monkeypatch):
    """`eval compare` with a bug inside: the handler of `main` is what is under test."""
    def broken(args):
        raise KeyError("summary")
    monkeypatch.setattr(posttrain.eval.cli, "_compare", broken)


def test_an_unexpected_error_is_one_line_and_exit_1(monkeypatch, capsys):
    _crashing_compare(monkeypatch)
    assert main(["eval", "compare", "a.json", "b.json"]) == 1
    assert one_line_error(capsys) == ("posttrain: internal error: KeyError: 'summary' (rerun with --debug for the "
                                      "traceback)")


def test_debug_shows_the_traceback_and_keeps_the_exit_code(monkeypatch, capsys):
    _crashing_compare(monkeypatch)
    assert main(["--debug", "eval", "compare", "a.json", "b.json"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "in broken" in err and "KeyError: 'summary'" in err
    assert main(["--debug", "data", "inspect", "missing.jsonl"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "posttrain: missing.jsonl: no such file or directory" in err


def test_every_named_bad_input_error_exists_where_the_cli_looks_for_it():
    # The CLI recognises these without importing them; a renamed or moved class must fail here.
    for module, name in BAD_INPUT_ERRORS:
        error = getattr(importlib.import_module(module), name)
        assert isinstance(error, type) and issubclass(error, Exception), (module, name)


def test_help_documents_debug(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "--debug" in out and "traceback" in out and "internal error" in out


def test_a_missing_model_directory_is_one_line_before_any_run_state(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = write_lines(tmp_path / "train.jsonl", [CHAT] * 4)
    assert main(sft("runs/demo/base-model", tmp_path, data)) == 2  # two slashes: a path, never a hub id
    line = one_line_error(capsys)
    assert "runs/demo/base-model: not an HF model directory (no such directory under" in line
    assert "posttrain model tiny runs/demo/base-model" in line
    assert not (tmp_path / "run").exists()  # refused before the output directory was made
    (tmp_path / "empty").mkdir()
    assert main(sft(str(tmp_path / "empty"), tmp_path, data)) == 2
    assert "(no config.json in it)" in one_line_error(capsys)


def test_a_name_that_is_no_directory_and_no_reachable_hub_model_is_one_line(tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # the same failure as no network
    monkeypatch.chdir(tmp_path)
    data = write_lines(tmp_path / "train.jsonl", [CHAT] * 4)
    assert main(sft("runs/base", tmp_path, data)) == 2  # a relative path of one slash, mistyped, or an org/name
    line = one_line_error(capsys)
    assert line.startswith("posttrain: runs/base: no such directory under")
    assert "loading it as a Hugging Face hub id failed" in line
