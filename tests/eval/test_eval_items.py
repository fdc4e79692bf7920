"""Suites from files and the registry; every bad line is reported with file, line and field."""

from __future__ import annotations

import json

import pytest

from posttrain.data.errors import DataError
from posttrain.data.records import Message, RLPrompt
from posttrain.eval.items import EvalItem, Suite, load_suite, read_items_jsonl, register_suite

GOOD = {"id": "a", "prompt": "What is 2+2?", "verifier": "numeric", "answer": 4, "group": "reasoning", "tier": 1}


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) if isinstance(r, dict) else r for r in rows) + "\n")
    return path


def test_jsonl_suite_loads(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", [GOOD, {**GOOD, "id": "b", "group": None, "tier": None}])
    suite = load_suite(path)
    assert suite.name == "mine" and [i.id for i in suite.items] == ["a", "b"]
    assert suite.items[0].answer == "4" and suite.items[1].group == "default"
    assert suite.group_weights == {}


@pytest.mark.parametrize(
    ("row", "field", "reason"),
    [
        ("{not json", None, "malformed JSON"),
        ({**GOOD, "verifer": "exact"}, "verifer", "did you mean `verifier`"),
        ({**GOOD, "tier": 5}, "tier", "less than or equal to 3"),
        ({**GOOD, "verifier": "numerik"}, "verifier", "did you mean `numeric`"),
        ({**GOOD, "answer": None}, "answer", "needs an expected `answer`"),
        ({k: v for k, v in GOOD.items() if k != "id"}, "id", "Field required"),
    ],
)
def test_bad_lines_name_file_line_and_field(tmp_path, row, field, reason):
    path = write_jsonl(tmp_path / "bad.jsonl", [{**GOOD, "id": "first"}, row])
    with pytest.raises(DataError) as exc:
        read_items_jsonl(path)
    assert exc.value.line == 2 and exc.value.field == field and reason in str(exc.value)
    assert str(exc.value).startswith(f"{path}:2")


def test_duplicate_ids_are_rejected(tmp_path):
    path = write_jsonl(tmp_path / "dup.jsonl", [GOOD, GOOD])
    with pytest.raises(DataError, match="duplicate id 'a' \\(first on line 1\\)"):
        read_items_jsonl(path)


def test_yaml_suite_with_weights_and_items_file(tmp_path):
    write_jsonl(tmp_path / "items.jsonl", [GOOD, {**GOOD, "id": "b", "group": "code", "verifier": "exact"}])
    (tmp_path / "suite.yaml").write_text("name: mine\ngroup_weights: {reasoning: 2, code: 1}\nitems_file: items.jsonl\n")
    suite = load_suite(tmp_path / "suite.yaml")
    assert suite.name == "mine" and suite.group_weights == {"reasoning": 2.0, "code": 1.0} and len(suite.items) == 2
    (tmp_path / "inline.json").write_text(json.dumps({"name": "inline", "items": [GOOD]}))
    assert load_suite(tmp_path / "inline.json").items[0].id == "a"
    (tmp_path / "typo.yaml").write_text("name: x\ngroup_weight: {a: 1}\nitems: []\n")
    with pytest.raises(DataError, match="group_weight"):
        load_suite(tmp_path / "typo.yaml")


def test_registry_and_unknown_names():
    smoke = load_suite("smoke")
    assert {i.verifier for i in smoke.items} == {"numeric", "multiple_choice", "exact", "contains", "ifeval", "code"}
    with pytest.raises(FileNotFoundError, match="did you mean `smoke`"):
        load_suite("smok")
    with pytest.raises(ValueError, match="already registered"):
        register_suite("smoke", lambda: smoke)


def test_suite_checks_ids_and_weights():
    with pytest.raises(ValueError, match="duplicate item id"):
        Suite("s", [GOOD, GOOD])
    with pytest.raises(ValueError, match="negative"):
        Suite("s", [GOOD], {"reasoning": -1})


def test_from_rl_prompt_and_prompt_forms():
    record = RLPrompt(prompt=[Message(role="user", content="What is 2+2?")], answer="4", verifier="numeric",
                      group="reasoning", tier=1)
    item = EvalItem.from_rl_prompt(record)
    assert item.id == record.id and item.verifier == "numeric" and item.group == "reasoning"
    assert item.prompt_messages()[0].content == "What is 2+2?"
    assert EvalItem(**GOOD).prompt_messages() == [Message(role="user", content="What is 2+2?")]


def test_a_broken_json_suite_names_line_and_column(tmp_path):
    path = tmp_path / "suite.json"
    path.write_text('{"name": "s",\n "items": [{"id": "a", "prompt": "q" "verifier": "exact"}]}')
    with pytest.raises(DataError) as caught:
        load_suite(path)
    assert caught.value.line == 2 and "Expecting ',' delimiter (column 38)" in caught.value.reason
