"""``posttrain feedback export``: the majority rule over latest votes, lineage, reproducible bytes, and files
that posttrain's own readers and ``posttrain feedback`` accept."""

from __future__ import annotations

import json
import secrets

import pytest

from posttrain.cli import main
from posttrain.data.io import read_records
from posttrain.serve.db import now, open_db
from posttrain.serve.export import decide, export_feedback
from posttrain.serve.monitor import admin_stats
from tests.serve.conftest import BACKENDS, edge_case


def _vote(db, user_id: int, case_id: str, winner_text: str | None, reason: str, choice: str | None = None,
          left_text: str | None = None) -> int:
    """A vote by ``user_id`` on the case's pair (0, 1) for the response whose text is ``winner_text`` (or ``choice``).

    The assignment is made here rather than by ``next_task`` so the test can pick the pair; its left/right
    order is drawn like the server's, and the vote names the side the text was shown on.
    """
    case = db.edge_case(case_id)
    a, b = case["responses"][0]["id"], case["responses"][1]["id"]
    left, right = (a, b) if secrets.randbelow(2) else (b, a)
    if left_text is not None:
        left, right = (a, b) if case["responses"][0]["text"] == left_text else (b, a)
    assignment = "t-" + secrets.token_hex(6)
    db.query("INSERT INTO assignments (id, edge_case_id, response_a_id, response_b_id, left_response_id, right_response_id,"
             " annotator_id, guideline_version, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
             (assignment, case_id, a, b, left, right, user_id, "g1", now()))  # fmt: skip
    if winner_text is not None:
        texts = {r["id"]: r["text"] for r in case["responses"]}
        choice = "left" if texts[left] == winner_text else "right"
    return db.add_vote(db.task(assignment), choice, reason, user_id)


@pytest.fixture(params=BACKENDS)
def voted(request, make_db_url):
    """A store with five pairs and votes that exercise every branch of the rule (see the asserts)."""
    db = open_db(make_db_url(request.param))
    ingest = db.create_user("ingest", "ingest")
    users = {name: db.user_for_token(db.create_user(name, "annotator"))["id"] for name in ("ann1", "ann2", "ann3")}
    del ingest
    ingest_id = db.user_for_token(db.create_user("ingest2", "ingest"))["id"]
    chat = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Capital of France?"}]
    cases = {
        "changed": db.add_edge_case(edge_case("What is 6 * 7?", ("41", "42")), ingest_id)["id"],
        "tie": db.add_edge_case(edge_case("Say hi", ("hi", "hello")), ingest_id)["id"],
        "bad": db.add_edge_case(edge_case("Square root of 2?", ("1.5", "1.3")), ingest_id)["id"],
        "split": db.add_edge_case(edge_case("Best colour?", ("red", "blue")), ingest_id)["id"],
        "chat": db.add_edge_case(edge_case(chat, ("Lyon", "Paris")), ingest_id)["id"],
    }
    ids = {}
    ids["first"] = _vote(db, users["ann1"], cases["changed"], "41", "41 looked right")
    _vote(db, users["ann2"], cases["changed"], "42", "6*7 is 42")
    ids["changed"] = _vote(db, users["ann1"], cases["changed"], "42", "42: I misread, 6*7=42")
    _vote(db, users["ann1"], cases["tie"], None, "both greet", choice="tie")
    _vote(db, users["ann2"], cases["tie"], None, "same", choice="tie")
    _vote(db, users["ann1"], cases["bad"], None, "both wrong: it is 1.414", choice="both_bad")
    _vote(db, users["ann1"], cases["split"], "red", "red is warm")
    _vote(db, users["ann2"], cases["split"], "blue", "blue is calm")
    _vote(db, users["ann1"], cases["chat"], "Paris", "Paris is the capital")
    _vote(db, users["ann2"], cases["chat"], "Paris", "Lyon is not the capital")
    _vote(db, users["ann3"], cases["chat"], "Lyon", "I like Lyon")
    yield db, cases, ids
    db.close()


def test_decide_rule():
    assert decide(["a", "a", "b"], 1) == ("a", None)
    assert decide(["a", "b"], 1) == (None, "no_majority")
    assert decide(["tie", "tie", "a"], 1) == (None, "tie")
    assert decide(["both_bad"], 1) == (None, "both_bad")
    assert decide(["a", "tie"], 1) == (None, "no_majority")
    assert decide(["b"], 2) == (None, "below_min_votes")


def test_export_follows_latest_votes_and_the_majority_rule(voted, tmp_path):
    db, cases, _ = voted
    manifest = export_feedback(db, tmp_path / "out")
    prefs = [json.loads(line) for line in (tmp_path / "out" / "preferences.jsonl").read_text().splitlines()]
    assert [(p["chosen"], p["rejected"]) for p in prefs] == [("42", "41"), ("Paris", "Lyon")]
    changed, chat = prefs
    assert changed["agreement"] == 1.0 and changed["annotators"] == ["ann2", "ann1"]  # ann1's latest vote counts
    assert changed["rationale"] == "6*7 is 42\n42: I misread, 6*7=42"
    assert chat["agreement"] == pytest.approx(2 / 3, abs=1e-6) and chat["annotators"] == ["ann1", "ann2"]
    assert chat["prompt"][0] == {"role": "system", "content": "Answer briefly."}
    lineage = changed["lineage"]
    assert lineage["edge_case_id"] == cases["changed"] and lineage["source"] == "test"
    assert lineage["chosen"]["model_id"] == "model-1" and lineage["rejected"]["model_id"] == "model-0"
    assert lineage["chosen"]["sampling"] == {"temperature": 0.7}
    assert [v["annotator"] for v in lineage["votes"]] == ["ann2", "ann1"] and lineage["guideline_versions"] == ["g1"]
    assert all(v["created_at"].endswith("Z") for v in lineage["votes"]) and len(lineage["content_hash"]) == 64
    assert manifest["skipped"] == {"both_bad": 1, "no_majority": 1, "tie": 1}
    assert manifest["vote_log"]["votes"] == 11 and manifest["counts"]["exported"] == 2
    sft = [json.loads(line) for line in (tmp_path / "out" / "sft.jsonl").read_text().splitlines()]
    assert sft[0]["messages"] == [{"role": "user", "content": "What is 6 * 7?"}, {"role": "assistant", "content": "42"}]
    feedback = [json.loads(line) for line in (tmp_path / "out" / "feedback.jsonl").read_text().splitlines()]
    assert (feedback[0]["bad_response"], feedback[0]["better_response"]) == ("41", "42")

    stricter = export_feedback(db, tmp_path / "min2", min_votes=2)
    assert stricter["skipped"] == {"below_min_votes": 1, "no_majority": 1, "tie": 1}


def test_until_reads_a_snapshot_of_the_log(voted, tmp_path):
    db, _, ids = voted
    # before ann1 changed their mind: ann1 says 41, ann2 says 42 -> no majority on that pair
    manifest = export_feedback(db, tmp_path / "early", until=str(ids["changed"] - 1))
    assert manifest["vote_log"]["votes"] == ids["changed"] - 1
    assert manifest["skipped"] == {"no_majority": 1}
    future = export_feedback(db, tmp_path / "late", until="2999-01-01T00:00:00Z")
    assert future["vote_log"]["votes"] == 11
    with pytest.raises(ValueError, match="vote id"):
        export_feedback(db, tmp_path / "bad", until="yesterday")


def test_export_is_byte_identical_and_loads_in_posttrain(voted, tmp_path):
    db, cases, _ = voted
    first, second, third = tmp_path / "one", tmp_path / "two", tmp_path / "three"
    assert main(["feedback", "export", "--db", db.url, "--out", str(first), "--until", "11"]) == 0
    assert main(["feedback", "export", "--db", db.url, "--out", str(second), "--until", "11"]) == 0
    # a vote appended after the snapshot changes nothing in an export up to the same vote...
    ann3 = db.one("SELECT id FROM users WHERE name = 'ann3'")["id"]
    _vote(db, ann3, cases["split"], "red", "red, to break the tie")
    assert main(["feedback", "export", "--db", db.url, "--out", str(third), "--until", "11"]) == 0
    for name in ("preferences.jsonl", "sft.jsonl", "feedback.jsonl", "manifest.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes() == (third / name).read_bytes(), name
    # ...and shows up in the next full export
    assert export_feedback(db, tmp_path / "four")["counts"]["exported"] == 3
    prefs, report = read_records(str(first / "preferences.jsonl"), kind="preference", progress=False)
    assert len(prefs) == 2 and report.quarantined == 0
    assert prefs[0].rationale.startswith("6*7 is 42") and prefs[0].meta["lineage"]["edge_case_id"]
    sft, report = read_records(str(first / "sft.jsonl"), kind="sft", progress=False)
    assert len(sft) == 2 and report.quarantined == 0 and sft[0].messages[-1].content == "42"
    merged = tmp_path / "merged"
    assert main(["feedback", f"output_dir={merged}", f"feedback={first / 'feedback.jsonl'}"]) == 0
    merged_prefs = [json.loads(line) for line in (merged / "preferences.jsonl").read_text().splitlines()]
    assert [(p["chosen"][0]["content"], p["rationale"]) for p in merged_prefs][0] == ("42", "6*7 is 42\n42: I misread, 6*7=42")
    assert len((merged / "sft.jsonl").read_text().splitlines()) == 2


def test_feedback_recipe_command_still_works(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["feedback", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--config" in out and "posttrain feedback export" in out
    with pytest.raises(SystemExit) as exc:
        main(["feedback", "export", "--help"])
    assert exc.value.code == 0 and "--min-votes" in capsys.readouterr().out
    assert main(["feedback", "export", "--db", "mysql://x", "--out", "/tmp/never"]) == 2
    assert "unsupported database URL" in capsys.readouterr().err


def test_admin_numbers_hand_computed(voted):
    db, _, _ = voted
    stats = admin_stats(db)
    assert stats["progress"] == {"edge_cases": 5, "pairs": 5, "pairs_with_1_vote": 5, "pairs_with_2_votes": 4, "votes": 11}
    assert stats["annotators"] == [{"name": "ann1", "votes": 6, "pairs": 5}, {"name": "ann2", "votes": 4, "pairs": 4},
                                   {"name": "ann3", "votes": 1, "pairs": 1}]  # fmt: skip
    # Latest labels (a = response 0): changed b/b, tie tie/tie, bad both_bad (ann1 only), split a/b, chat b/b/a (ann3 a).
    # ann1 vs ann2 on 4 shared pairs: [b, tie, a, b] vs [b, tie, b, b]: p_o = 3/4,
    # p_e = (2*3 [b] + 1*1 [tie] + 1*0 [a]) / 16 = 7/16, kappa = (12/16 - 7/16) / (9/16) = 5/9
    kappas = {tuple(row["annotators"]): (row["shared"], row["kappa"]) for row in stats["agreement"]["cohen_kappa"]}
    assert kappas[("ann1", "ann2")] == (4, pytest.approx(5 / 9))
    assert kappas[("ann1", "ann3")] == (1, pytest.approx(0.0))  # b vs a on one pair: p_o = 0 = p_e
    # alpha over the 4 pairs with >= 2 annotators: o_bb = 2 + 1, o_tt = 2, o_ab = o_ba = 1 + 1; n_b = 5, n_a = 2,
    # n_tie = 2, n = 9; alpha = 1 - 8 * 4 / (2 * (5*2 + 5*2 + 2*2)) = 1 - 32/48 = 1/3
    assert stats["agreement"]["krippendorff_alpha"] == pytest.approx(1 / 3)
    # length: decisive latest votes whose responses differ in length: split red(a)/blue(b) x2, chat Lyon(a)/Paris(b)
    # x3 -> the longer won for ann2 on split and ann1, ann2 on chat: 3 of 5, two-sided binomial p = 1
    assert stats["length_bias"] == {"n": 5, "k": 3, "share": 0.6, "p_value": pytest.approx(1.0)}
    assert stats["position_bias"]["n"] == 7  # every decisive latest vote, whichever side it was shown on
    assert stats["recent_votes"][0]["reason"] == "I like Lyon"


def test_position_bias_counts_the_left_shown_winner(make_db_url):
    db = open_db(make_db_url("sqlite"))
    ingest = db.user_for_token(db.create_user("ingest", "ingest"))["id"]
    users = [db.user_for_token(db.create_user(f"a{i}", "annotator"))["id"] for i in range(4)]
    case = db.add_edge_case(edge_case("Pick one", ("x", "y")), ingest)["id"]
    for user, (winner, left) in zip(users, [("x", "x"), ("y", "y"), ("x", "x"), ("x", "y")], strict=True):
        _vote(db, user, case, winner, "reason", left_text=left)
    assert admin_stats(db)["position_bias"] == {"n": 4, "k": 3, "share": 0.75, "p_value": pytest.approx(10 / 16)}
    db.close()
