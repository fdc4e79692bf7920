"""Bad input stops with one line that names the file (and line, field) and says what to do.

Each case was a traceback or a misleading message before: a truncated ``.gz`` (``EOFError``), a chat that
opens with an assistant turn (a ``TemplateError`` deep in tokenisation, even with quarantine on), a file
whose records are all or mostly quarantined (``ValueError: the training set is empty``), and JSON
errors reported at the wrong column.
"""

from __future__ import annotations

import gzip
import json

import pytest

from posttrain.data.errors import DataError
from posttrain.data.formats import EMPTY_PROMPT, FormatError, convert
from posttrain.data.io import iter_raw_records, parse_json_line, read_records
from posttrain.data.read_report import MAX_QUARANTINED_SHARE

CHAT = {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]}


def write_lines(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


# ------------------------------------------------------------------------------ truncated compressed files


def test_a_truncated_gz_is_one_data_error_naming_the_file(tmp_path):
    whole = gzip.compress(("".join(json.dumps(CHAT) + "\n" for _ in range(200))).encode())
    path = tmp_path / "train.jsonl.gz"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataError) as caught:
        read_records(str(path), progress=False)
    message = str(caught.value)
    assert message.startswith(f"{path}:") and "\n" not in message
    assert "truncated or corrupt" in message and "gzip" in message


def test_a_truncated_gz_json_array_is_one_data_error_too(tmp_path):
    whole = gzip.compress(json.dumps([CHAT] * 200).encode())
    path = tmp_path / "train.json.gz"
    path.write_bytes(whole[: len(whole) - 40])
    with pytest.raises(DataError, match="truncated or corrupt"):
        list(iter_raw_records(str(path)))


# ------------------------------------------------------------------- a chat that opens with an assistant turn

ASSISTANT_FIRST = [
    ({"messages": [{"role": "assistant", "content": "Hi! Ask me anything."}, *CHAT["messages"]]}, "messages[0].role"),
    ({"conversations": [{"from": "gpt", "value": "Hello."}, {"from": "human", "value": "2+2?"},
                        {"from": "gpt", "value": "4"}]}, "conversations[0].from"),
    ({"prompt": [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}],
      "completion": "4"}, "prompt[0].role"),
]


@pytest.mark.parametrize(("raw", "field"), ASSISTANT_FIRST)
def test_a_chat_that_starts_with_an_assistant_turn_is_refused_with_its_category(raw, field):
    with pytest.raises(FormatError) as caught:
        convert(raw, kind="sft")
    assert caught.value.category == EMPTY_PROMPT and caught.value.field == field
    assert "starts with an assistant turn" in caught.value.reason


def test_assistant_first_chats_are_quarantined_with_their_reason(tmp_path):
    path = write_lines(tmp_path / "train.jsonl", [CHAT, ASSISTANT_FIRST[0][0], CHAT, CHAT])
    quarantine = tmp_path / "q.jsonl"
    records, report = read_records(path, kind="sft", on_error="quarantine", quarantine_path=str(quarantine),
                                   progress=False)
    assert len(records) == 3 and report.quarantined == 1 and report.reasons == {EMPTY_PROMPT: 1}
    entry = json.loads(quarantine.read_text())
    assert entry["line"] == 2 and entry["field"] == "messages[0].role"
    assert "starts with an assistant turn" in entry["reason"]
    # After a system prompt an assistant greeting has a prompt to render (the system turn): it is kept.
    system_first = {"messages": [{"role": "system", "content": "Be brief."}, *ASSISTANT_FIRST[0][0]["messages"]]}
    record, _ = convert(system_first, kind="sft")
    assert [m.role for m in record.messages] == ["system", "assistant", "user", "assistant"]


# ----------------------------------------------------------------------------------- JSON error positions


def test_a_truncated_line_is_reported_where_it_ends_not_where_its_string_starts():
    line = json.dumps(CHAT)[:-12]  # cut inside the last content string
    bad = parse_json_line(line.encode())
    assert f"column {len(line) + 1}" in bad.reason and "truncated" in bad.reason
    assert f"starts at column {line.rindex(chr(34)) + 1}" in bad.reason
    cut_between = json.dumps(CHAT)[:-2]  # cut between values
    assert f"column {len(cut_between) + 1}" in parse_json_line(cut_between.encode()).reason


def test_an_error_inside_a_line_keeps_its_own_column():
    line = '{"messages": [{"role": "user" "content": "hi"}]}'  # a missing comma: the next value starts at column 31
    assert "Expecting ',' delimiter (column 31)" in parse_json_line(line.encode()).reason


def test_a_truncated_json_array_names_the_line_and_column_where_the_file_ends(tmp_path):
    path = tmp_path / "train.json"
    path.write_text("[\n" + json.dumps(CHAT) + ",\n" + json.dumps(CHAT)[:30] + "\n")
    with pytest.raises(DataError) as caught:
        list(iter_raw_records(str(path)))
    assert caught.value.line == 3 and "column 31" in caught.value.reason and "truncated" in caught.value.reason
    path.write_text("[\n" + json.dumps(CHAT) + ",\n\n")  # cut right after a comma: not "line 4, column 1"
    with pytest.raises(DataError) as caught:
        list(iter_raw_records(str(path)))
    assert caught.value.line == 2 and f"column {len(json.dumps(CHAT)) + 2}" in caught.value.reason


# ------------------------------------------------------------------- empty or mostly quarantined training sets


def _checked(tmp_path, rows, kind="sft"):
    path = write_lines(tmp_path / "train.jsonl", rows)
    _, report = read_records(path, kind=kind, on_error="quarantine",
                             quarantine_path=str(tmp_path / "quarantine.jsonl"), progress=False)
    report.check_usable("training set")
    return report


def test_an_empty_file_is_an_empty_training_set(tmp_path):
    with pytest.raises(DataError) as caught:
        _checked(tmp_path, ["", "  "])
    message = str(caught.value)
    assert "the training set is empty" in message and "no records" in message and "2 blank lines" in message


def test_a_file_in_an_unknown_format_names_reasons_keys_and_formats(tmp_path):
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(6)]
    with pytest.raises(DataError) as caught:
        _checked(tmp_path, rows)
    message = str(caught.value)
    assert "\n" not in message and "the training set is empty" in message
    assert "all 6 records read were quarantined" in message
    assert "unknown format: 6 (lines 1, 2, 3, 4, 5)" in message and "keys (answer, question)" in message
    assert "Detected format: none" in message and "`messages` (OpenAI)" in message
    assert "quarantine.jsonl" in message


def test_records_of_another_kind_say_what_they_are_and_how_to_convert(tmp_path):
    rows = [{"prompt": f"What is {i}+1?", "answer": str(i + 1)} for i in range(4)]
    with pytest.raises(DataError) as caught:
        _checked(tmp_path, rows)
    message = str(caught.value)
    assert "Detected format: rl (4)" in message and "wrong record kind: 4" in message
    assert "`posttrain sample`" in message  # the conversion hint of an RL prompt given to SFT


@pytest.mark.parametrize(("bad", "good", "stops"), [(3, 2, True), (2, 2, False), (1, 4, False)])
def test_more_than_half_quarantined_stops_the_run(tmp_path, bad, good, stops):
    assert MAX_QUARANTINED_SHARE == 0.5
    rows = [{"text": "no format"}] * bad + [CHAT] * good
    if stops:
        with pytest.raises(DataError) as caught:
            _checked(tmp_path, rows)
        assert f"{bad} of {bad + good} records read" in str(caught.value)
        assert "more than half" in str(caught.value)
        assert f"Detected format: messages ({good}), no known format ({bad})" in str(caught.value)
    else:
        report = _checked(tmp_path, rows)
        assert report.accepted == good

