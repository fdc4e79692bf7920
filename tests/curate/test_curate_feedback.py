"""Feedback ingestion: edge cases merged into SFT and preference sets, deduplicated, with lineage."""

from __future__ import annotations

import json

import pytest

from posttrain.cli import main
from posttrain.config import load_config
from posttrain.curate.config import FeedbackRecipe
from posttrain.curate.feedback import ingest_feedback
from posttrain.data.errors import DataError
from posttrain.data.records import PreferencePair, SFTExample

from .conftest import read_jsonl, write_jsonl

LONG = "Explain in two sentences why the moon shows phases to an observer on the earth during a month"


def test_merge_dedup_and_lineage(tmp_path):
    sft = write_jsonl(tmp_path / "sft.jsonl", [
        {"id": "old-1", "messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]},
        {"id": "old-2", "messages": [{"role": "user", "content": LONG},
                                     {"role": "assistant", "content": "Because sunlight hits it at changing angles."}]},
    ])  # fmt: skip
    prefs = write_jsonl(tmp_path / "prefs.jsonl", [
        {"prompt": [{"role": "user", "content": "Say hi"}], "chosen": [{"role": "assistant", "content": "Hi!"}],
         "rejected": [{"role": "assistant", "content": "No."}], "rationale": "polite"},
    ])  # fmt: skip
    feedback = write_jsonl(tmp_path / "feedback.jsonl", [
        {"id": "fb1", "prompt": "What is 7 * 6?", "bad_response": "48", "better_response": "42", "reason": "wrong product"},
        {"prompt": "What is 2 + 2?", "bad_response": "5", "better_response": "4", "reason": "already in SFT"},
        {"prompt": "Please " + LONG, "bad_response": "It just does.",
         "better_response": "Because sunlight hits it at changing angles.", "reason": "near copy"},
        {"prompt": "What is 7 * 6?", "bad_response": "48", "better_response": "42", "reason": "repeat in the file"},
        {"prompt": "Same?", "bad_response": "yes", "better_response": "yes ", "reason": "identical"},
        {"prompt": "Missing fields"},
        "garbage",
    ])  # fmt: skip
    out = tmp_path / "merged"
    config = load_config(FeedbackRecipe, None, [f"output_dir={out}", f"feedback={feedback}", f"sft={sft}",
                                                f"preferences={prefs}", "tier=2"])  # fmt: skip
    manifest = ingest_feedback(config)
    merged_sft, merged_prefs = read_jsonl(out / "sft.jsonl"), read_jsonl(out / "preferences.jsonl")
    # Existing records come first, unchanged; then the new ones.
    assert [r["id"] for r in merged_sft[:2]] == ["old-1", "old-2"]
    new_sft = merged_sft[2:]
    assert [r["messages"][-1]["content"] for r in new_sft] == ["42"]
    assert new_sft[0]["tier"] == 2 and new_sft[0]["meta"]["feedback"]["reason"] == "wrong product"
    new_pairs = merged_prefs[1:]
    # The 2 + 2 pair is new as a preference (only its SFT twin existed); the near copy of old-2 is not a near
    # copy of any existing pair either.
    assert sorted(p["rationale"] for p in new_pairs) == ["already in SFT", "near copy", "wrong product"]
    for record in merged_sft:
        SFTExample.model_validate(record)
    for record in merged_prefs:
        PreferencePair.model_validate(record)
    funnel = manifest["funnel"]
    assert funnel["sft"]["input"] == 7 == funnel["sft"]["kept"] + funnel["sft"]["dropped"]
    assert funnel["preferences"]["kept"] == 3 and funnel["sft"]["total"] == 3
    sft_dedup = next(s for s in funnel["sft"]["stages"] if s["stage"] == "dedup")
    assert sft_dedup["dropped"] == {"exact_duplicate": 2, "near_duplicate": 1}
    parse = next(s for s in funnel["sft"]["stages"] if s["stage"] == "parse")
    assert parse["dropped"] == {"identical_responses": 1, "missing_field": 1, "malformed_json": 1}
    assert [p["path"] for p in manifest["parents"]] == [str(feedback), str(sft), str(prefs)]
    assert len(read_jsonl(out / "dropped.jsonl")) == 3 + 3 + 1  # parse drops once, dedup drops per target


def test_cli_feedback_without_existing_sets(tmp_path, capsys):
    feedback = write_jsonl(tmp_path / "fb.jsonl", [{"prompt": "Q?", "bad_response": "x", "better_response": "y"}])
    code = main(["feedback", f"feedback={feedback}", f"output_dir={tmp_path / 'o'}"])
    assert code == 0 and "[sft] existing 0, total 1" in capsys.readouterr().out


def test_existing_sets_must_be_valid_records_of_their_kind(tmp_path):
    feedback = write_jsonl(tmp_path / "fb.jsonl", [{"prompt": "Q?", "bad_response": "x", "better_response": "y"}])
    sft = write_jsonl(tmp_path / "sft.jsonl", [
        {"messages": [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}]},
        {"prompt": "Q2", "chosen": "A2", "rejected": "B2"},
    ])  # fmt: skip
    config = load_config(FeedbackRecipe, None, [f"output_dir={tmp_path / 'o'}", f"feedback={feedback}", f"sft={sft}"])
    with pytest.raises(DataError) as info:
        ingest_feedback(config)
    assert (info.value.path, info.value.line) == (str(sft), 2) and "drop `rejected`" in info.value.reason


def test_feedback_and_existing_sets_in_other_formats(tmp_path):
    from posttrain.data.io import write_records
    from posttrain.data.records import PreferencePair

    feedback = tmp_path / "fb.json"
    feedback.write_text(json.dumps([{"prompt": [{"role": "user", "content": "What is 7 * 6?"}],
                                     "bad_response": "48", "better_response": "42", "reason": "wrong product"},
                                    {"prompt": "", "bad_response": "a", "better_response": "b"}]))  # fmt: skip
    old_pair = PreferencePair(prompt=[{"role": "user", "content": "What is 7 * 6?"}],
                              chosen=[{"role": "assistant", "content": "42"}],
                              rejected=[{"role": "assistant", "content": "48"}])  # fmt: skip
    prefs = tmp_path / "prefs.parquet"
    write_records(str(prefs), [old_pair])
    out = tmp_path / "o"
    config = load_config(FeedbackRecipe, None, [f"output_dir={out}", f"feedback={feedback}", f"preferences={prefs}"])
    funnel = ingest_feedback(config)["funnel"]
    parse = next(s for s in funnel["preferences"]["stages"] if s["stage"] == "parse")
    assert parse["dropped"] == {"empty_prompt": 1}
    dedup = next(s for s in funnel["preferences"]["stages"] if s["stage"] == "dedup")
    assert dedup["dropped"] == {"exact_duplicate": 1}  # the same pair as the one already in the Parquet set
    assert [r["id"] for r in read_jsonl(out / "preferences.jsonl")] == [old_pair.id]
    assert [r["messages"][-1]["content"] for r in read_jsonl(out / "sft.jsonl")] == ["42"]
