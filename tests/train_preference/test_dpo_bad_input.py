"""Bad preference records follow the data layer's rules: a clear error naming file:line and field, or
quarantine with a reason — and every record is accounted for."""

from __future__ import annotations

from tests.train_preference.conftest import dpo_overrides, preference_rows, read_jsonl, run_cli, write_jsonl


def bad_file(tmp_path):
    rows = preference_rows(16, seed=3)
    rows[2] = {"prompt": rows[2]["prompt"], "chosen": rows[2]["chosen"]}  # no `rejected`
    rows[5] = {**rows[5], "rejected": rows[5]["chosen"]}  # identical chosen and rejected
    rows[9] = {**rows[9], "prompt": "   "}  # empty prompt
    return write_jsonl(tmp_path / "bad.jsonl", rows)


def test_bad_pairs_stop_the_run_with_file_line_and_field(pref_model_dir, tmp_path, capsys):
    path = bad_file(tmp_path)
    code = run_cli("dpo", dpo_overrides(pref_model_dir, {"train": str(path)}, tmp_path / "out"))
    assert code == 2
    err = capsys.readouterr().err
    assert f"{path}:3:" in err and "rejected" in err
    assert not (tmp_path / "out" / "final").exists()


def test_bad_pairs_are_quarantined_with_reasons_and_counts_add_up(pref_model_dir, tmp_path, capsys):
    path = bad_file(tmp_path)
    out = tmp_path / "out"
    extra = {"data.on_error": "quarantine", "train.max_steps": 1, "dpo.prefix_sharing": "false"}
    assert run_cli("dpo", dpo_overrides(pref_model_dir, {"train": str(path)}, out, **extra)) == 0
    quarantined = read_jsonl(out / "quarantine.jsonl")
    assert [q["line"] for q in quarantined] == [3, 6, 10]
    reasons = " | ".join(q["reason"] for q in quarantined)
    assert "rejected" in quarantined[0]["field"] and "identical" in reasons and "empty" in reasons
    assert all(q["raw"] for q in quarantined)  # the record itself is kept for a person to fix
    err = capsys.readouterr().err
    assert "read 16 = accepted 13 + quarantined 3" in err
    assert "13 pairs accepted = 13 used + 0 dropped" in err
    assert len(read_jsonl(out / "pairs.jsonl")) == 13


def test_pairs_spoiled_by_truncation_are_listed_with_their_reason(pref_model_dir, tmp_path, capsys):
    rows = preference_rows(12, seed=4)
    long = "apple and plum and " * 12
    rows.append({"prompt": "Name two fruits.", "chosen": long + "peach.", "rejected": long + "rock."})
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "out"
    extra = {"train.max_length": 32, "train.max_steps": 1, "train.batch_size": 4}
    assert run_cli("dpo", dpo_overrides(pref_model_dir, {"train": str(path)}, out, **extra)) == 0
    dropped = read_jsonl(out / "dropped_pairs.jsonl")
    assert [d["reason"] for d in dropped] == ["chosen and rejected are identical after truncation"]
    assert "13 pairs accepted = 12 used + 1 dropped" in capsys.readouterr().err
    assert dropped[0]["id"] not in {row["id"] for row in read_jsonl(out / "pairs.jsonl")}
