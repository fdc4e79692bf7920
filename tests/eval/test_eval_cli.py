"""`posttrain eval` and `posttrain eval compare` from the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.eval.sandbox import sandbox_support

REFERENCE = {
    "smoke-add": "42", "smoke-compare": "The answer: 71", "smoke-half": "3.5", "smoke-choice": "(B)",
    "smoke-reverse": "olleh", "smoke-upper": "DOG.", "smoke-fruit": "apple, pear, fig",
    "smoke-lower": "a cat is a small soft animal.", "smoke-bullets": "- red\n- blue",
    "smoke-json": '{"name": "posttrain"}', "smoke-code-add": "```python\ndef add(a, b):\n    return a + b\n```",
    "smoke-code-rev": "def rev(s):\n    return s[::-1]",
}
SUITE_ROWS = [
    {"id": f"add-{a}-{b}", "prompt": f"What is {a} plus {b}?", "verifier": "numeric", "answer": str(a + b),
     "group": "reasoning" if a % 2 else "arithmetic", "tier": 1 + a % 3}
    for a in range(6) for b in range(5)
]


def write_outputs(path, outputs):
    path.write_text("".join(json.dumps({"id": k, "output": v}) + "\n" for k, v in outputs.items()))
    return path


@pytest.mark.skipif(not sandbox_support()[0], reason="the smoke suite has code items")
def test_eval_outputs_reference_answers_score_100(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(["eval", "--outputs", str(write_outputs(tmp_path / "o.jsonl", REFERENCE)), "--suite", "smoke",
                 "-o", str(out), "--quiet", "--n-boot", "200"])
    assert code == 0
    results = json.loads(out.read_text())
    assert results["counts"]["passed"] == 12 and results["scores"]["composite"]["score"] == 100.0
    assert set(results["scores"]["groups"]) == {"reasoning", "transformation", "instruction_following", "code"}
    row = results["items"][0]
    assert {"id", "group", "tier", "prompt", "output", "score", "passed", "detail"} <= set(row)
    assert "composite index" in capsys.readouterr().out


def test_eval_missing_outputs_exit_2_unless_allowed(tmp_path, capsys):
    suite = tmp_path / "s.jsonl"
    suite.write_text("".join(json.dumps(r) + "\n" for r in SUITE_ROWS[:3]))
    outputs = write_outputs(tmp_path / "o.jsonl", {"add-0-0": "0", "stray": "1"})
    assert main(["eval", "--outputs", str(outputs), "--suite", str(suite), "--quiet"]) == 2
    assert "2 of 3 suite items have no output" in capsys.readouterr().err
    out = tmp_path / "r.json"
    assert main(["eval", "--outputs", str(outputs), "--suite", str(suite), "--quiet", "--allow-missing",
                 "-o", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [r["detail"] for r in results["items"]][1:] == ["missing output", "missing output"]
    assert results["counts"]["missing_outputs"] == 2 and results["unmatched_output_ids"] == ["stray"]


def test_eval_model_then_compare(tmp_path, tiny_model_dir, capsys):
    suite = tmp_path / "suite.jsonl"
    suite.write_text("".join(json.dumps(r) + "\n" for r in SUITE_ROWS))
    base = tmp_path / "base.json"
    code = main(["eval", "--model", tiny_model_dir, "--suite", str(suite), "-o", str(base), "--max-new-tokens", "4",
                 "--quiet", "--n-boot", "200"])
    assert code == 0
    base_results = json.loads(base.read_text())
    assert len(base_results["items"]) == 30 and all(r["finish_reason"] for r in base_results["items"])
    assert base_results["model"] == tiny_model_dir and base_results["config"]["sampling"]["temperature"] == 0.0

    # A "new model" that answers 25 of the 30 items correctly, scored from outputs alone.
    fixed = {r["id"]: str(int(r["answer"]) + (1 if i < 5 else 0)) for i, r in enumerate(SUITE_ROWS)}
    new = tmp_path / "new.json"
    assert main(["eval", "--outputs", str(write_outputs(tmp_path / "o.jsonl", fixed)), "--suite", str(suite),
                 "-o", str(new), "--quiet", "--n-boot", "200"]) == 0
    capsys.readouterr()
    comparison = tmp_path / "cmp.json"
    assert main(["eval", "compare", str(base), str(new), "-o", str(comparison), "--n-perm", "2000"]) == 0
    printed = capsys.readouterr().out
    result = json.loads(comparison.read_text())
    expected = 25 / 30 * 100 - base_results["scores"]["composite"]["score"]
    groups = base_results["scores"]["groups"]
    assert result["composite"]["delta"] == pytest.approx(
        sum(result["weights"][g] * (new_g["score"] - groups[g]["score"])
            for g, new_g in json.loads(new.read_text())["scores"]["groups"].items()))
    assert result["paired"] == 30
    assert expected > 50  # the random tiny model answers (almost) nothing right
    assert result["composite"]["significant"] and "significant improvement" in printed
    assert printed.startswith("composite index:")

    assert main(["eval", "compare", str(base), str(base)]) == 0
    assert "No change is statistically significant" in capsys.readouterr().out


def test_eval_requires_a_source_and_suite(capsys):
    assert main(["eval", "--suite", "smoke"]) == 2
    assert "give --model DIR" in capsys.readouterr().err
    assert main(["eval", "--outputs", "x.jsonl"]) == 2
    assert "--suite is required" in capsys.readouterr().err


def test_lm_eval_missing_prints_install_hint(capsys, tiny_model_dir):
    try:
        import lm_eval  # noqa: F401
        pytest.skip("lm-eval is installed here")
    except ImportError:
        pass
    assert main(["eval", "--lm-eval", "hellaswag", "--model", tiny_model_dir]) == 2
    assert "pip install 'posttrain[lm-eval]'" in capsys.readouterr().err


def test_compare_rejects_non_results(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"suite": "x"}')
    assert main(["eval", "compare", str(bad), str(bad)]) == 2
    assert "not a `posttrain eval` results file" in capsys.readouterr().err


def _results_of(tmp_path, name: str, rows: list[dict], outputs: dict[str, str]) -> str:
    """`posttrain eval --outputs` of ``outputs`` on a suite of ``rows``; returns the results path."""
    suite = tmp_path / f"{name}.jsonl"
    suite.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / f"{name}.json"
    assert main(["eval", "--outputs", str(write_outputs(tmp_path / f"{name}-outputs.jsonl", outputs)), "--suite",
                 str(suite), "-o", str(out), "--quiet", "--n-boot", "100"]) == 0
    return str(out)


def test_eval_results_store_a_content_hash_per_item(tmp_path):
    rows = SUITE_ROWS[:3]
    changed = [dict(rows[0]), dict(rows[1], answer="999"), dict(rows[2], prompt="What is 2 times 2?")]
    answers = {r["id"]: r["answer"] for r in rows}
    first = json.loads(Path(_results_of(tmp_path, "first", rows, answers)).read_text())["items"]
    second = json.loads(Path(_results_of(tmp_path, "second", changed, answers)).read_text())["items"]
    hashes = [(a["content_hash"], b["content_hash"]) for a, b in zip(first, second, strict=True)]
    assert hashes[0][0] == hashes[0][1]  # same item, same hash
    assert hashes[1][0] != hashes[1][1] and hashes[2][0] != hashes[2][1]  # another answer key / prompt


def test_compare_refuses_two_suites_that_share_ids_but_not_questions(tmp_path, capsys):
    # issue #11: same ids, other prompts and answer keys, compared as if equal (+8.3 points).
    other = [dict(r, prompt=r["prompt"].replace("plus", "times"), answer=str(int(r["prompt"].split()[2]) *
             int(r["prompt"].split()[4].rstrip("?")))) for r in SUITE_ROWS]
    base = _results_of(tmp_path, "base", SUITE_ROWS, {r["id"]: "0" for r in SUITE_ROWS})
    new = _results_of(tmp_path, "new", other, {r["id"]: r["answer"] for r in other})
    capsys.readouterr()
    assert main(["eval", "compare", base, new]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "differ in prompt, tests or answer" in err and "Traceback" not in err
    # Two of the 30 changed: those are reported and left out; the other 28 are compared.
    mixed = SUITE_ROWS[:28] + other[28:]
    new = _results_of(tmp_path, "mixed", mixed, {r["id"]: r["answer"] for r in mixed})
    capsys.readouterr()
    assert main(["eval", "compare", base, new, "--n-perm", "500"]) == 0
    printed = capsys.readouterr().out
    assert "2 items share an id but differ in prompt, tests or answer" in printed
    assert f"{other[28]['id']}, {other[29]['id']}" in printed


def test_compare_with_no_shared_ids_is_one_line_and_exit_2(tmp_path, capsys):
    base = tmp_path / "a.json"
    base.write_text(json.dumps({"suite": "s", "items": [{"id": "a", "group": "g", "score": 1.0}]}))
    new = tmp_path / "b.json"
    new.write_text(json.dumps({"suite": "s", "items": [{"id": "b", "group": "g", "score": 0.0}]}))
    assert main(["eval", "compare", str(base), str(new)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "posttrain eval: the two results share no item ids, so there is nothing to compare (were they " \
                  "run on the same suite?)"


def test_compare_names_the_position_of_broken_json(tmp_path, capsys):
    bad = tmp_path / "cut.json"
    bad.write_text('{"suite": "s",\n "items": [{"id": "a", "sco')
    assert main(["eval", "compare", str(bad), str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2: malformed JSON: an unterminated string: the text ends before the JSON is complete, at column 28" \
        in err
    assert "the string starts at column 24" in err
    scored = tmp_path / "scored.json"
    scored.write_text(json.dumps({"suite": "s", "items": [{"id": "a", "group": "g", "score": "abc"}]}))
    assert main(["eval", "compare", str(scored), str(scored)]) == 2
    assert "items[0]: `score` must be a number in [0, 1], got 'abc'" in capsys.readouterr().err


def test_eval_refuses_several_samples_per_item(tmp_path, tiny_model_dir, capsys):
    suite = tmp_path / "s.jsonl"
    suite.write_text(json.dumps(SUITE_ROWS[0]) + "\n")
    assert main(["eval", "--model", tiny_model_dir, "--suite", str(suite), "--n", "2", "--quiet"]) == 2
    assert "--n must be 1 (got 2)" in capsys.readouterr().err
