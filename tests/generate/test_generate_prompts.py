"""``posttrain generate``'s prompt file goes through the data layer: any record format, any record file."""

from __future__ import annotations

import json

import pytest

from posttrain.data.errors import DataError
from posttrain.data.io import write_records
from posttrain.data.records import Message, RLPrompt
from posttrain.generate.cli import read_prompts


def test_prompts_of_every_kind_of_record(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"id": "a", "prompt": "What is 12 plus 30?"},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
        {"conversations": [{"from": "human", "value": "Name a fruit."}]},
        {"instruction": "Say hi.", "output": "hi"},
        {"prompt": "q", "chosen": "a", "rejected": "b"},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + "\n")
    prompts = read_prompts(path)
    assert [key for key, _ in prompts] == ["a", "2", "3", "4", "5"]
    assert prompts[0][1] == "What is 12 plus 30?" and prompts[4][1] == "q"  # plain-text prompts stay text
    assert prompts[1][1] == [Message(role="user", content="Hi")]  # the chat without its reply
    assert prompts[2][1] == [Message(role="user", content="Name a fruit.")]
    assert prompts[3][1] == [Message(role="user", content="Say hi.")]


def test_prompts_from_parquet_and_text_files(tmp_path):
    write_records(str(tmp_path / "p.parquet"), [RLPrompt(id="x", prompt=[Message(role="user", content="2+2?")])])
    assert read_prompts(tmp_path / "p.parquet") == [("x", [Message(role="user", content="2+2?")])]
    (tmp_path / "p.txt").write_text("first\n\nsecond\n")
    assert read_prompts(tmp_path / "p.txt") == [("1", "first"), ("3", "second")]


@pytest.mark.parametrize(
    ("row", "field", "words"),
    [
        ({"text": "x"}, "prompt", "needs `prompt`"),
        ({"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "prompt",
         "nothing to answer"),
        ({"prompt": [{"role": "wizard", "content": "q"}]}, "prompt[0].role", "unknown role"),
        ({"prompt": "  "}, "prompt", "is empty"),
    ],
)
def test_bad_prompt_lines_name_file_line_and_field(tmp_path, row, field, words):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError) as info:
        read_prompts(path)
    assert (info.value.line, info.value.field) == (2, field) and words in info.value.reason


def test_duplicate_ids_and_malformed_lines_stop_the_read(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"id": 1, "prompt": "a"}) + "\n" + json.dumps({"id": "1", "prompt": "b"}) + "\n")
    with pytest.raises(DataError, match="duplicate id '1'"):
        read_prompts(path)
    path.write_text("{oops\n")
    with pytest.raises(DataError, match=r"prompts.jsonl:1: malformed JSON"):
        read_prompts(path)
