"""Two flywheel turns on a reduced budget: round 2 starts from round 1's model and learns from its failures,
captured, annotated and exported through the feedback service (a real server on 127.0.0.1 over SQLite)."""

from __future__ import annotations

import json
import sqlite3

import pytest
import yaml

from posttrain.cli import main
from posttrain.eval.items import EvalItem
from posttrain.flywheel.feedback_loop import verifier_vote
from tests.flywheel.reduced import reduced_recipe


@pytest.fixture(scope="module")
def two_rounds(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("rounds") / "run"
    path = reduced_recipe(run_dir, rounds=2, feedback={"dev_per_cell": 2, "samples": 3, "max_new_tokens": 6},
                          next_round={"raw_pool": 120, "rl_prompts": 24, "unkeyed_share": 0.5,
                                      "off_topic_share": 0.1, "curate": {"intent.enabled": False},
                                      "sft": {"train.max_steps": 3}, "dpo": {"train.max_steps": 2}})
    recipe = yaml.safe_load(path.read_text())
    recipe["sft"]["overrides"]["train.max_steps"] = 40  # enough that some greedy answers are not empty
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert main(["flywheel", "--config", str(path)]) == 0
    return run_dir, path


def _outputs(run_dir, stage):
    return json.loads((run_dir / stage / "stage.json").read_text())["outputs"]


def test_round_two_starts_from_round_one_and_is_indexed_for_the_report(two_rounds):
    run_dir, _ = two_rounds
    index = json.loads((run_dir / "rounds.json").read_text())
    assert [r["round"] for r in index["rounds"]] == [1, 2]
    second = index["rounds"][1]
    assert second["start"] == "round1/dpo" and second["dir"] == "round2"
    sft_config = yaml.safe_load((run_dir / "round2" / "sft" / "config.yaml").read_text())
    assert sft_config["model"]["path"] == str(run_dir / "dpo" / "final")
    dpo_config = yaml.safe_load((run_dir / "round2" / "dpo" / "config.yaml").read_text())
    assert dpo_config["model"]["path"] == str(run_dir / "round2" / "sft" / "final")
    across = json.loads((run_dir / index["across"]).read_text())
    assert list(across) == ["round1/dpo->round2/dpo"]
    # Round 2 is scored on round 1's held-out suite, item for item.
    first = json.loads((run_dir / "eval_dpo" / "results.json").read_text())
    later = json.loads((run_dir / "round2" / "eval_dpo" / "results.json").read_text())
    assert [i["id"] for i in first["items"]] == [i["id"] for i in later["items"]]


def test_failures_go_through_the_service_and_every_vote_has_a_reason(two_rounds):
    run_dir, _ = two_rounds
    capture, annotate = _outputs(run_dir, "round2/capture"), _outputs(run_dir, "round2/annotate")
    dev = json.loads((run_dir / "round2" / "capture" / "results.json").read_text())
    failed = [i for i in dev["items"] if not i["passed"]]
    assert capture["failures"] + capture["empty_failures"] == len(failed)
    assert capture["failures"] > 0
    with sqlite3.connect(run_dir / "feedback.db") as db:
        cases = db.execute("SELECT signal, source FROM edge_cases").fetchall()
        responses = db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]
        votes = db.execute("SELECT reason, annotator_id FROM votes").fetchall()
        versions = {row[0] for row in db.execute("SELECT guideline_version FROM votes")}
    assert len(cases) == capture["captured"]
    assert all(json.loads(signal)["type"] == "failed_verifier" and source == "flywheel/round1/dev"
               for signal, source in cases)
    assert responses == capture["captured"] + capture["alternatives"]
    assert len(votes) == annotate["votes"] == capture["alternatives"]  # one vote per (failure, alternative)
    assert all(reason.strip() for reason, _ in votes) and len({a for _, a in votes}) == 1
    assert versions == {"flywheel-v1"}  # the guideline shown with each pair is recorded with its vote
    exported = _outputs(run_dir, "round2/export")
    assert exported["counts"]["pairs_with_votes"] == annotate["votes"]


def test_round_two_curates_with_the_model_judge_and_merges_the_export(two_rounds):
    run_dir, _ = two_rounds
    funnel = json.loads((run_dir / "round2" / "curate" / "funnel.json").read_text())
    assert "model_judge" in [s["stage"] for s in funnel["stages"]]
    curate = json.loads((run_dir / "round2" / "curate" / "manifest.json").read_text())["config"]
    assert curate["model_judge"]["enabled"] and curate["model_judge"]["model"] == str(run_dir / "dpo" / "final")
    manifest = json.loads((run_dir / "round2" / "feedback" / "manifest.json").read_text())
    parents = json.dumps(manifest)
    assert "round2/export/feedback.jsonl" in parents and "round2/curate/kept.jsonl" in parents


def test_a_rerun_of_two_rounds_skips_every_stage(two_rounds, capsys):
    run_dir, path = two_rounds
    assert main(["flywheel", "--config", str(path)]) == 0
    err = capsys.readouterr().err
    assert "round2/annotate: unchanged" in err and ": running" not in err


def test_rerunning_capture_and_annotate_adds_no_case_and_no_vote(two_rounds, capsys):
    """A changed guideline re-runs capture and annotate: the cases are already there (idempotent by content
    hash) and the same annotator (its token kept under feedback_tokens/) has nothing left to vote on."""
    run_dir, path = two_rounds
    with sqlite3.connect(run_dir / "feedback.db") as db:
        before = [db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("edge_cases", "responses", "votes")]
    recipe = yaml.safe_load(path.read_text())
    recipe["feedback"].update(guideline="A new guideline text.", guideline_version="flywheel-v2")
    changed = path.with_name("changed-guideline.yaml")
    changed.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert main(["flywheel", "--config", str(changed)]) == 0
    assert "round2/annotate: running" in capsys.readouterr().err
    with sqlite3.connect(run_dir / "feedback.db") as db:
        after = [db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("edge_cases", "responses", "votes")]
        annotators = db.execute("SELECT COUNT(DISTINCT annotator_id) FROM votes").fetchone()[0]
    assert after == before and annotators == 1
    assert _outputs(run_dir, "round2/capture")["already_captured"] == before[0]


def test_a_changed_round_two_dpo_re_evaluates_round_two_not_round_one(two_rounds, capsys):
    """Round 1's final stage is ``dpo``, the name of round 2's own: round 2's eval of its DPO model must depend on
    round 2's DPO stage (it once depended on round 1's by that name, and kept a stale score when only round 2's
    DPO changed)."""
    run_dir, path = two_rounds
    assert main(["flywheel", "--config", str(path)]) == 0  # back to the fixture's recipe (a test above changes it)
    capsys.readouterr()
    recipe = yaml.safe_load(path.read_text())
    recipe["next_round"]["dpo"] = {**recipe["next_round"]["dpo"], "train.lr": 2.0e-4}
    changed = path.with_name("changed-round2-dpo.yaml")
    changed.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert main(["flywheel", "--config", str(changed)]) == 0
    err = capsys.readouterr().err
    for name in ("round2/dpo", "round2/eval_dpo", "round2/compare"):
        assert f"{name}: running" in err, name
    for name in ("round2/sft", "round2/eval_sft", "dpo", "eval_dpo"):
        assert f"\n[flywheel] {name}: unchanged" in err, name


NUMERIC = EvalItem(id="x", prompt="What is 15 + 27?", verifier="numeric", answer="42", group="reasoning", tier=1,
                   options={"tolerance": 0})


def test_the_scripted_annotator_names_what_each_answer_gives():
    choice, reason = verifier_vote(NUMERIC, "41", "42")
    assert choice == "right"
    assert reason.startswith("B gives '42'") and "expected answer is '42'" in reason and "A gives '41'" in reason
    choice, _ = verifier_vote(NUMERIC, "The answer is 42.", "40")
    assert choice == "left"
    assert verifier_vote(NUMERIC, "42", "42.0")[0] == "tie"
    choice, reason = verifier_vote(NUMERIC, "7", "8")
    assert choice == "both_bad" and "neither passes" in reason


def test_a_failure_the_service_would_refuse_is_counted_as_empty_not_posted():
    """The capture posts only what the feedback service stores: an answer of invisible characters (a zero-width
    space, a BOM) or with a NUL would make the service refuse the case and stop the round."""
    from posttrain.flywheel.feedback_loop import _storable

    assert [_storable(text) for text in ("42", " 42 ", "", "  \n", "\u200b", "\ufeff\u200d", "4\x002")] == [
        True, True, False, False, False, False, False]


GRPO_QUICK = {"train.max_steps": 2, "train.global_batch_size": 4, "train.batch_size": 8, "train.max_length": 96,
              "train.save_every": None, "rl.group_size": 4, "rl.max_new_tokens": 6, "rl.rollout_batch_size": 16,
              "reward.workers": 0}


def test_with_grpo_every_round_ends_with_grpo_and_trains_on_its_own_samples(tmp_path):
    """``grpo.enabled``: round 2 runs the whole pipeline, GRPO after its DPO on its own fresh prompts, and is
    compared with round 1's GRPO model; ``next_round.sft_from_samples`` adds the sample stage's SFT targets (the
    previous final model's best-of-n answers at or above the sample stage's ``min_score``) to round 2's SFT set.
    This barely trained model passes no verifier, so ``min_score`` is 0 here (every best answer is kept); the
    quickstart's 1.0 keeps only answers that pass (the sample stage's filter, tested with it)."""
    run_dir = tmp_path / "run"
    path = reduced_recipe(run_dir, rounds=2, feedback={"dev_per_cell": 2, "samples": 3, "max_new_tokens": 6,
                                                       "reference_answers": True},
                          next_round={"raw_pool": 120, "rl_prompts": 36, "curate": {"intent.enabled": False},
                                      "sft": {"train.max_steps": 3}, "dpo": {"train.max_steps": 2},
                                      "sample": {"min_score": 0.0}, "sft_from_samples": True, "replay": True})
    recipe = yaml.safe_load(path.read_text())
    recipe["sft"]["overrides"]["train.max_steps"] = 40  # some sampled answers pass, so some samples are kept
    recipe["grpo"].update(enabled=True, eval_prompts=0, overrides={**recipe["grpo"]["overrides"], **GRPO_QUICK})
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert main(["flywheel", "--config", str(path)]) == 0

    index = json.loads((run_dir / "rounds.json").read_text())
    second = index["rounds"][1]
    assert second["start"] == "round1/grpo" and second["final"] == "grpo" and second["models"][-1] == "grpo"
    grpo = yaml.safe_load((run_dir / "round2" / "grpo" / "config.yaml").read_text())
    assert grpo["model"]["path"] == str(run_dir / "round2" / second["models"][-2] / "final")
    prompts = [json.loads(line) for line in (run_dir / "round2" / "grpo" / "prompts.jsonl").read_text().splitlines()]
    round_two_prompts = (run_dir / "round2" / "data" / "prompts.jsonl").read_text()
    assert prompts and {p["group"] for p in prompts} == set(recipe["grpo"]["groups"])
    assert all(p["id"] in round_two_prompts for p in prompts)  # round 2's fresh prompts, not round 1's
    assert list(json.loads((run_dir / index["across"]).read_text())) == ["round1/grpo->round2/grpo"]
    compared = json.loads((run_dir / "round2" / "compare" / "comparisons.json").read_text())
    assert f"{second['models'][-2]}->grpo" in compared and "start->grpo" in compared

    kept = (run_dir / "round2" / "curate" / "kept.jsonl").read_text().splitlines()
    sampled = [json.loads(line) for line in (run_dir / "round2" / "sample" / "sft.jsonl").read_text().splitlines()]
    assert sampled and all(row["meta"]["sample"]["score"] >= 0.0 for row in sampled)
    merged = (run_dir / "round2" / "sft_data" / "sft.jsonl").read_text().splitlines()
    replayed = (run_dir / "curate" / "kept.jsonl").read_text().splitlines()  # next_round.replay: round 1's curated set
    sampled_lines = (run_dir / "round2" / "sample" / "sft.jsonl").read_text().splitlines()
    assert replayed and merged == kept + sampled_lines + replayed
    feedback = json.loads((run_dir / "round2" / "feedback" / "manifest.json").read_text())
    assert "round2/sft_data/sft.jsonl" in json.dumps(feedback)

    # feedback.reference_answers: a failure none of whose alternatives passes gets the annotator's write-in (the
    # dev item's answer), and the pair it wins is exported with that lineage.
    capture = _outputs(run_dir, "round2/capture")
    dev = {json.loads(line)["id"]: json.loads(line) for line in
           (run_dir / "round2" / "data" / "dev_suite.jsonl").read_text().splitlines()}
    with sqlite3.connect(run_dir / "feedback.db") as db:
        written = db.execute("SELECT r.text, e.metadata FROM responses r JOIN edge_cases e ON r.edge_case_id = e.id "
                             "WHERE r.model_id = 'annotator-reference'").fetchall()
    assert capture["reference_answers"] == len(written) > 0
    assert all(text == dev[json.loads(meta)["dev_item"]]["answer"] for text, meta in written)
    pairs = [json.loads(line) for line in (run_dir / "round2" / "export" / "preferences.jsonl").read_text().splitlines()]
    won = [p for p in pairs if p["lineage"]["chosen"]["model_id"] == "annotator-reference"]
    assert won and all(p["chosen"] == dev[p["lineage"]["metadata"]["dev_item"]]["answer"] for p in won)


def test_sft_from_samples_without_a_min_score_is_refused_before_anything_runs(tmp_path, capsys):
    path = reduced_recipe(tmp_path / "run", rounds=2, next_round={"sft_from_samples": True})
    assert main(["flywheel", "--config", str(path), "next_round.sample.min_score=null"]) == 2
    assert "next_round.sample.min_score" in capsys.readouterr().err
    assert not (tmp_path / "run" / "data").exists()
