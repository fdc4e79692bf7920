"""``posttrain data inspect``: formats, counts, token lengths, every bad record by reason; exit 2 when any is bad."""

from __future__ import annotations

import json

import pytest

from posttrain.cli import main
from posttrain.data.inspect import length_stats
from posttrain.data.io import write_records
from posttrain.data.samples import sample_sft_records
from posttrain.data.tokenize import tokenize_chat

PAIR = {"prompt": "Name a fruit.", "chosen": "apple", "rejected": "chair"}


@pytest.fixture
def sample_file(tmp_path):
    path = tmp_path / "train.jsonl"
    write_records(str(path), sample_sft_records(20))
    return path


def test_counts_and_token_lengths(sample_file, tiny_model_dir, tiny_tokenizer, capsys):
    lengths = sorted(len(tokenize_chat(r, tiny_tokenizer, 10**6)) for r in sample_sft_records(20))
    limit = lengths[10]
    code = main(["data", "inspect", str(sample_file), "--model", tiny_model_dir, "--max-length", str(limit), "--json"])
    assert code == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["report"]["read"] == payload["report"]["accepted"] == 20
    assert payload["report"]["formats"] == {"messages": 20} and payload["report"]["kinds"] == {"sft": 20}
    stats = payload["tokens"]["sft"]
    assert (stats["count"], stats["min"], stats["max"]) == (20, lengths[0], lengths[-1])
    assert stats["over_max_length"] == sum(n > limit for n in lengths) > 0


def test_human_output_is_a_table(sample_file, tiny_model_dir, capsys):
    assert main(["data", "inspect", str(sample_file), "--model", tiny_model_dir]) == 0
    out = capsys.readouterr().out
    assert "read 20 = accepted 20 + quarantined 0" in out
    assert "format    messages 20" in out
    header = next(line for line in out.splitlines() if "p50" in line)
    assert header.split()[:7] == ["kind", "count", "min", "p50", "p90", "p99", "max"]
    assert "bad records: none" in out


def test_every_bad_record_is_counted_by_default_and_the_exit_code_says_so(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    rows = [json.dumps(PAIR), json.dumps({"prompt": "q", "chosen": "a", "rejected": 3}), json.dumps(PAIR), "{broken",
            json.dumps(dict(PAIR, rejected="apple"))]
    path.write_text("\n".join(rows) + "\n")
    assert main(["data", "inspect", str(path)]) == 2
    captured = capsys.readouterr()
    assert "read 5 = accepted 2 + quarantined 3" in captured.out  # the read went past the first bad record
    table = captured.out.split("bad records")[1]
    assert "malformed JSON" in table and "identical chosen/rejected" in table
    err = captured.err.strip().splitlines()[-1]
    assert err.startswith(f"posttrain: {path}: 3 bad records") and "line 2" in err and "--on-error" in err


def test_raise_mode_stops_at_the_first_bad_record_naming_file_line_and_field(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(PAIR) + "\n" + json.dumps({"prompt": "q", "chosen": "a", "rejected": 3}) + "\n")
    assert main(["data", "inspect", str(path), "--on-error", "raise"]) == 2
    captured = capsys.readouterr()
    assert f"{path}:2: `rejected`: expected a string or a list of messages, got int" in captured.err
    assert captured.out == ""


def test_quarantine_mode_reports_bad_records_by_reason(tmp_path, capsys):
    path = tmp_path / "mixed.jsonl"
    lines = [json.dumps(PAIR), "{broken", json.dumps(dict(PAIR, rejected="apple")), json.dumps(dict(PAIR, prompt=" ")),
             "{also broken"]
    path.write_text("\n".join(lines) + "\n")
    quarantine = tmp_path / "q.jsonl"
    code = main(["data", "inspect", str(path), "--on-error", "quarantine", "--quarantine-file", str(quarantine)])
    assert code == 0
    out = capsys.readouterr().out
    assert "read 5 = accepted 1 + quarantined 4" in out
    table = out.split("bad records")[1].splitlines()
    malformed = next(line for line in table if "malformed JSON" in line)
    assert malformed.split()[2:] == ["2", "2,", "5"]  # count, then the first lines it was seen on
    assert next(line for line in table if "identical chosen/rejected" in line).split()[-2:] == ["1", "3"]
    assert next(line for line in table if "empty prompt" in line).split()[-2:] == ["1", "4"]
    assert len(quarantine.read_text().splitlines()) == 4


def test_kind_filter_and_forced_format(tmp_path, capsys):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(PAIR) + "\n")
    assert main(["data", "inspect", str(path), "--kind", "sft"]) == 2
    assert "wrong record kind      1" in capsys.readouterr().out
    assert main(["data", "inspect", str(path), "--kind", "sft", "--on-error", "raise"]) == 2
    assert "where 'sft' records are expected" in capsys.readouterr().err
    assert main(["data", "inspect", str(path), "--format", "preference", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["report"]["formats"] == {"preference": 1}


def test_preference_and_rl_lengths(tmp_path, tiny_model_dir, capsys):
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps(PAIR) + "\n" + json.dumps({"prompt": "What is 2 plus 2?", "answer": "4"}) + "\n")
    assert main(["data", "inspect", str(path), "--model", tiny_model_dir, "--json"]) == 0
    tokens = json.loads(capsys.readouterr().out)["tokens"]
    assert set(tokens) == {"preference", "rl"}
    assert tokens["preference"]["count"] == tokens["rl"]["count"] == 1


def test_quarantine_file_is_refused_in_raise_mode(sample_file, tmp_path, capsys):
    args = ["data", "inspect", str(sample_file), "--quarantine-file", str(tmp_path / "q.jsonl")]
    assert main([*args, "--on-error", "raise"]) == 2
    assert "needs --on-error count or quarantine" in capsys.readouterr().err
    assert main(args) == 0 and not (tmp_path / "q.jsonl").exists()  # count mode: nothing bad, nothing written


def test_length_stats_uses_actual_lengths():
    stats = length_stats([5, 1, 3, 2, 4, 100], max_length=4)
    assert (stats["min"], stats["p50"], stats["max"], stats["over_max_length"]) == (1, 3, 100, 2)
    assert length_stats([], 4) == {"count": 0, "over_max_length": 0}


def test_counts_the_formats_users_bring(tmp_path, capsys):
    path = tmp_path / "brought.jsonl"
    hh = {"chosen": "\n\nHuman: Name a fruit.\n\nAssistant: apple", "rejected": "\n\nHuman: Name a fruit.\n\nAssistant: x"}
    rows = [hh, {"prompt": "q", "completion": "a"}, {"prompt": "q2", "response": "a2"}, {"prompt": "q", "answer": "1"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["data", "inspect", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["report"]
    assert report["formats"] == {"hh_rlhf": 1, "prompt_completion": 2, "rl": 1}
    assert report["kinds"] == {"preference": 1, "sft": 2, "rl": 1}
