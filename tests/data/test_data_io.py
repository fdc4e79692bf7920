"""Readers and writers: errors name file, line and field; quarantine accounts for every bad record;
JSONL, JSON arrays, gzip, Parquet and saved HF datasets round-trip."""

from __future__ import annotations

import gzip
import json

import pytest

from posttrain.data.errors import DataError
from posttrain.data.formats import BLANK_LINE, INVALID_UTF8, MALFORMED_JSON, NOT_AN_OBJECT
from posttrain.data.io import (
    BadLine,
    append_jsonl,
    iter_jsonl,
    iter_raw_records,
    jsonl_writer,
    parse_json_line,
    peek_records,
    read_jsonl,
    read_records,
    source_layout,
    write_jsonl,
    write_records,
)
from posttrain.data.records import PreferencePair, RLPrompt, SFTExample
from posttrain.data.samples import sample_sft_records

GOOD_SFT = {"messages": [{"role": "user", "content": "What is 1 plus 1?"}, {"role": "assistant", "content": "2"}]}
GOOD_PAIR = {"prompt": "Name a fruit.", "chosen": "apple", "rejected": "chair", "rationale": "a chair is furniture"}

# (name, bad line as bytes, expected field or None, expected category)
BAD_LINES = [
    ("malformed JSON", b'{"messages": [{"role": "user", "content": "hi"}', None, "malformed JSON"),
    ("missing field", json.dumps({"messages": [{"role": "user", "content": "q"}, {"content": "a"}]}).encode(),
     "messages[1].role", "missing field"),
    ("mistyped field", json.dumps({"messages": [{"role": "user", "content": "q"},
                                                {"role": "assistant", "content": ["a"]}]}).encode(),
     "messages[1].content[0]", "wrong type"),
    ("invalid UTF-8", b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', None, "invalid UTF-8"),
    ("empty message", json.dumps({"messages": [{"role": "user", "content": "q"},
                                               {"role": "assistant", "content": "   "}]}).encode(),
     "messages[1].content", "empty message"),
    ("identical chosen/rejected", json.dumps({"prompt": "q", "chosen": "same", "rejected": "same"}).encode(),
     "rejected", "identical chosen/rejected"),
    ("empty prompt", json.dumps({"prompt": "  ", "chosen": "a", "rejected": "b"}).encode(), "prompt", "empty prompt"),
]


def write_lines(path, lines: list[bytes]) -> str:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return str(path)


def good(record: dict) -> bytes:
    return json.dumps(record).encode()


@pytest.mark.parametrize(("name", "bad", "field", "category"), BAD_LINES, ids=[b[0] for b in BAD_LINES])
def test_raise_mode_names_file_line_and_field(tmp_path, name, bad, field, category):
    path = write_lines(tmp_path / "data.jsonl", [good(GOOD_SFT), good(GOOD_PAIR), bad, good(GOOD_SFT)])
    with pytest.raises(DataError) as info:
        read_records(path, progress=False)
    error = info.value
    assert (error.path, error.line, error.field) == (path, 3, field)
    assert str(error).startswith(f"{path}:3: ")
    if field:
        assert f"`{field}`" in str(error)


def test_quarantine_writes_every_bad_record_with_its_reason(tmp_path):
    lines = [good(GOOD_SFT)]
    for _, bad, _, _ in BAD_LINES:
        lines += [bad, good(GOOD_PAIR)]
    path = write_lines(tmp_path / "data.jsonl", lines)
    quarantine = tmp_path / "out" / "quarantine.jsonl"
    quarantine.parent.mkdir()
    records, report = read_records(path, on_error="quarantine", quarantine_path=str(quarantine), progress=False)

    assert report.read == len(lines) == report.accepted + report.quarantined
    assert report.quarantined == len(BAD_LINES) and len(records) == report.accepted == 1 + len(BAD_LINES)
    assert dict(report.reasons) == {category: 1 for *_, category in BAD_LINES}
    entries = [json.loads(line) for line in quarantine.read_text(encoding="utf-8").splitlines()]
    assert [entry["line"] for entry in entries] == [2 + 2 * i for i in range(len(BAD_LINES))]
    assert [entry["field"] for entry in entries] == [field for _, _, field, _ in BAD_LINES]
    assert all(entry["reason"] and entry["file"] == path for entry in entries)
    assert "caf\\xe9" in entries[3]["raw"]  # the undecodable byte is shown, not lost
    assert "quarantined 7" in report.summary() and str(quarantine) in report.summary()


def test_quarantine_without_a_file_still_counts(tmp_path, caplog):
    path = write_lines(tmp_path / "data.jsonl", [good(GOOD_SFT), BAD_LINES[0][1]])
    records, report = read_records(path, on_error="quarantine", progress=False)
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "read 2 = accepted 1 + quarantined 1" in caplog.records[0].getMessage()
    assert (report.read, report.accepted, report.quarantined) == (2, 1, 1)
    assert report.example_lines["malformed JSON"] == [2]
    assert "(not saved)" in report.summary()


def test_clean_read_creates_no_quarantine_file(tmp_path):
    path = write_lines(tmp_path / "data.jsonl", [good(GOOD_SFT)])
    quarantine = tmp_path / "q.jsonl"
    read_records(path, on_error="quarantine", quarantine_path=str(quarantine), progress=False)
    assert not quarantine.exists()


def test_wrong_kind_is_an_error(tmp_path):
    path = write_lines(tmp_path / "pairs.jsonl", [good(GOOD_PAIR)])
    with pytest.raises(DataError, match=r"pairs.jsonl:1: a 'preference' record .* where 'sft' records") as info:
        read_records(path, kind="sft", progress=False)
    assert "SFT needs `messages`" in str(info.value) and "drop `rejected`" in str(info.value)
    _, report = read_records(path, kind="sft", on_error="quarantine", progress=False)
    assert report.reasons == {"wrong record kind": 1}


def test_forced_format_applies_to_every_record(tmp_path):
    path = write_lines(tmp_path / "data.jsonl", [good(GOOD_PAIR), good(GOOD_SFT)])
    with pytest.raises(DataError) as info:
        read_records(path, fmt="preference", progress=False)
    assert (info.value.line, info.value.field) == (2, "prompt")


def test_blank_lines_are_skipped_and_reported(tmp_path):
    path = write_lines(tmp_path / "data.jsonl", [good(GOOD_SFT), b"", b"  ", good(GOOD_SFT)])
    records, report = read_records(path, progress=False)
    assert (report.read, report.blank_lines, len(records)) == (2, 2, 2)


def test_line_numbers_count_blank_lines_and_a_bom(tmp_path):
    path = write_lines(tmp_path / "data.jsonl", [b"\xef\xbb\xbf" + good(GOOD_SFT), b"", b"{oops"])
    with pytest.raises(DataError) as info:
        read_records(path, progress=False)
    assert info.value.line == 3


def test_iter_jsonl_raises_on_a_malformed_line(tmp_path):
    path = write_lines(tmp_path / "x.jsonl", [b'{"a": 1}', b"[1, 2]"])
    iterator = iter_jsonl(path)
    assert next(iterator) == (1, {"a": 1})
    with pytest.raises(DataError, match=r"x.jsonl:2: expected a JSON object, got list"):
        next(iterator)


def test_json_array_file_with_line_numbers(tmp_path):
    path = tmp_path / "alpaca.json"
    path.write_text('[\n  {"instruction": "Say hi", "output": "hi"},\n  {"instruction": "", "output": "x"}\n]\n')
    with pytest.raises(DataError) as info:
        read_records(str(path), progress=False)
    assert (info.value.line, info.value.field) == (3, "instruction")
    records, report = read_records(str(path), on_error="quarantine", progress=False)
    assert report.formats == {"alpaca": 1} and report.quarantined == 1


def test_unsupported_suffix_and_missing_file(tmp_path):
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        read_records(str(tmp_path / "data.csv"))
    with pytest.raises(FileNotFoundError):
        read_records(str(tmp_path / "nothing.jsonl"))


def _mixed_records():
    sft = sample_sft_records(5, seed=3)
    sft[0].meta["nested"] = {"list": [1, 2], "text": "é"}
    pair = PreferencePair(prompt=[{"role": "user", "content": "q"}], chosen=[{"role": "assistant", "content": "a"}],
                          rejected=[{"role": "assistant", "content": "b"}], rationale="a is right",
                          chosen_score=1.0, tier=2)
    rl = RLPrompt(prompt=[{"role": "user", "content": "2+2?"}], answer="4", verifier="exact", difficulty=0.3)
    return [*sft, pair, rl]


@pytest.mark.parametrize("name", ["data.jsonl", "data.jsonl.gz", "data.parquet"])
def test_write_then_read_round_trips(tmp_path, name):
    records = _mixed_records()
    path = str(tmp_path / name)
    write_records(path, records)
    back, report = read_records(path, progress=False)
    assert back == records
    assert report.kinds == {"sft": 5, "preference": 1, "rl": 1}
    if name.endswith(".gz"):
        assert gzip.open(path).readline().startswith(b"{")


def test_saved_hf_dataset_round_trips(tmp_path):
    datasets = pytest.importorskip("datasets")
    records = sample_sft_records(6)
    rows = [{"messages": [m.model_dump() for m in r.messages], "id": r.id, "tier": r.tier,
             "difficulty": r.difficulty, "meta": json.dumps(r.meta)} for r in records]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    back, report = read_records(str(tmp_path / "ds"), kind="sft", progress=False)
    assert back == records and report.read == 6


def test_saved_dataset_dict_needs_one_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    split = datasets.Dataset.from_list([GOOD_SFT])
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match="point at one split"):
        read_records(str(tmp_path / "dd"), progress=False)
    records, _ = read_records(str(tmp_path / "dd" / "train"), progress=False)
    assert isinstance(records[0], SFTExample)


def test_parquet_errors_name_the_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([GOOD_PAIR, dict(GOOD_PAIR, rejected=GOOD_PAIR["chosen"])])
    pq.write_table(table, tmp_path / "pairs.parquet")
    with pytest.raises(DataError) as info:
        read_records(str(tmp_path / "pairs.parquet"), progress=False)
    assert (info.value.line, info.value.field) == (2, "rejected")


def test_write_refuses_unknown_suffix(tmp_path):
    with pytest.raises(ValueError, match="use .jsonl or .parquet"):
        write_records(str(tmp_path / "x.csv"), [])


# -- the one JSON-line decoder and the one writer ------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "category"),
    [
        (b"", BLANK_LINE),
        (b"  \r\n", BLANK_LINE),
        (b"caf\xe9", INVALID_UTF8),
        (b'{"text": "\\ud800"}', INVALID_UTF8),  # a lone surrogate cannot be written back as UTF-8
        (b"{oops", MALFORMED_JSON),
        (b"[" * 100_000 + b"]" * 100_000, MALFORMED_JSON),  # too deep to parse: not a crash
        (b"[1, 2]", NOT_AN_OBJECT),
        (b'"text"', NOT_AN_OBJECT),
    ],
)
def test_parse_json_line_names_what_is_wrong(line, category):
    result = parse_json_line(line)
    assert isinstance(result, BadLine) and result.category == category and result.reason


def test_parse_json_line_accepts_objects_with_line_endings_and_surrogate_pairs():
    assert parse_json_line(b'{"a": 1}\r\n') == {"a": 1}
    assert parse_json_line(b'{"emoji": "\\ud83d\\ude00"}') == {"emoji": "\U0001f600"}


def test_iter_raw_records_yields_blank_and_bad_lines_with_their_numbers(tmp_path):
    path = write_lines(tmp_path / "raw.jsonl", [good(GOOD_SFT), b"", b"{bad", good(GOOD_PAIR)])
    items = list(iter_raw_records(path))
    assert [line for line, _ in items] == [1, 2, 3, 4]
    assert [item.category for _, item in items if isinstance(item, BadLine)] == [BLANK_LINE, MALFORMED_JSON]
    assert items[3][1] == GOOD_PAIR


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.jsonl.gz"])
def test_write_jsonl_round_trips_and_appends(tmp_path, name):
    path = str(tmp_path / "sub" / name)
    rows = [{"a": 1, "text": "é"}, {"b": [1, 2]}]
    assert write_jsonl(path, rows) == 2
    assert read_jsonl(path) == rows
    if not name.endswith(".gz"):
        assert append_jsonl(path, [{"c": None}]) == 1
        assert read_jsonl(path) == [*rows, {"c": None}]


def test_jsonl_writer_leaves_the_old_file_when_the_writing_fails(tmp_path):
    path = tmp_path / "out.jsonl"
    write_jsonl(str(path), [{"old": True}])
    with pytest.raises(RuntimeError):
        with jsonl_writer(str(path)) as out:
            out.write({"new": 1})
            raise RuntimeError("interrupted")
    assert read_jsonl(str(path)) == [{"old": True}]
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]  # no temporary file left behind


def test_source_layout(tmp_path):
    lines = write_lines(tmp_path / "a.json", [good(GOOD_SFT)])
    (tmp_path / "b.json").write_text(json.dumps([GOOD_SFT]))
    assert (source_layout(lines), source_layout(str(tmp_path / "b.json"))) == ("lines", "rows")
    write_records(str(tmp_path / "c.parquet"), sample_sft_records(1))
    assert source_layout(str(tmp_path / "c.parquet")) == "rows"


def test_hh_rlhf_and_prompt_completion_files_read_by_kind(tmp_path):
    hh = {"chosen": "\n\nHuman: Name a fruit.\n\nAssistant: apple",
          "rejected": "\n\nHuman: Name a fruit.\n\nAssistant: chair"}
    path = write_lines(tmp_path / "hh.jsonl", [good(hh), good({"prompt": "q", "completion": "a"})])
    records, report = read_records(path, kind="preference", on_error="quarantine", progress=False)
    assert report.formats == {"hh_rlhf": 1} and report.reasons == {"wrong record kind": 1}
    assert records[0].prompt[0].content == "Name a fruit."


def test_a_lone_surrogate_in_a_json_array_is_bad_utf8_too(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('[{"prompt": "q", "completion": "\\ud800"}, {"prompt": "q", "completion": "\\ud83d\\ude00"}]')
    records, report = read_records(str(path), on_error="quarantine", progress=False)
    assert report.reasons == {INVALID_UTF8: 1} and records[0].messages[-1].content == "\U0001f600"


# Lines that end exactly at, or straddle, a chunk boundary; the last without a line ending; blank and CRLF lines.
SPLIT_CASES = [b"", b"\n", b"ab\ncd", b"ab\r\ncd\r\n", b"\n\nabc\n", b"abcdefgh\nx\n", b"a" * 20 + b"\nb\n" + b"c" * 9,
               b"123456789\n12345678\n1234567890"]


@pytest.mark.parametrize("data", SPLIT_CASES)
@pytest.mark.parametrize("chunk", [1, 3, 8, 1 << 20])
def test_split_lines_reads_in_chunks_and_bounds_each_line(monkeypatch, data, chunk):
    import io

    from posttrain.data import lines

    monkeypatch.setattr(lines, "READ_CHUNK", chunk)
    pieces = data.split(b"\n")
    expected = pieces[:-1] + ([pieces[-1]] if pieces[-1] else [])  # what `for line in handle` gives, unterminated
    got = list(lines.split_lines(io.BytesIO(data), max_bytes=9))
    assert len(got) == len(expected)
    for line, want in zip(got, expected, strict=True):
        if len(want) > 9:
            assert isinstance(line, lines.LineTooLong) and line.size == len(want)
            assert len(line.head) > 9 and want.startswith(line.head)  # its start, to recognise it by
        else:
            assert line == want


def test_to_plain_jsonl_copies_lines_of_any_length_and_keeps_line_numbers(tmp_path):
    import gzip

    from posttrain.data.io import to_plain_jsonl

    source = tmp_path / "in.jsonl.gz"
    lines = [b"\xef\xbb\xbf" + good(GOOD_SFT), b"", b'{"long": "' + b"z" * (3 << 20) + b'"}', good(GOOD_PAIR)]
    source.write_bytes(gzip.compress(b"\n".join(lines)))  # no line ending after the last line
    target = tmp_path / "out.jsonl"
    sizes = list(to_plain_jsonl(str(source), str(target)))
    copied = target.read_bytes()
    assert copied == b"\n".join([lines[0][3:], *lines[1:]]) + b"\n"
    assert [number for number, _ in sizes] == [1, 2, 3, 4]
    assert [size for _, size in sizes] == [len(line) + 1 for line in copied.split(b"\n")[:-1]]


# --- peek_records: the look before a run writes or loads anything ------------------------------------


def test_peek_reads_a_small_file_whole_as_the_full_read_does_and_writes_nothing(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(GOOD_SFT) + "\n\n" + json.dumps({"prompt": "Only a prompt."}) + "\n"
                    + json.dumps(GOOD_SFT) + "\n")
    peek = peek_records(str(path), "sft", on_error="quarantine")
    _, full = read_records(str(path), "sft", on_error="quarantine")
    assert peek.complete and len(peek.records) == 2
    assert (peek.report.read, peek.report.accepted, peek.report.quarantined, peek.report.blank_lines) == \
        (full.read, full.accepted, full.quarantined, full.blank_lines) == (3, 2, 1, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.jsonl"]  # no quarantine file
    with pytest.raises(DataError, match=r"train\.jsonl:3: "):  # on_error=raise: the full read's first error
        peek_records(str(path), "sft")


def test_peek_stops_at_its_limit_across_shards_and_says_so(tmp_path, monkeypatch):
    import posttrain.data.io

    shards = tmp_path / "train"
    shards.mkdir()
    for index in range(3):
        (shards / f"part-{index}.jsonl").write_text((json.dumps(GOOD_SFT) + "\n") * 4)
    monkeypatch.setattr(posttrain.data.io, "PEEK_RECORDS", 6)
    peek = peek_records(str(shards), "sft")
    assert not peek.complete and len(peek.records) == 6 and peek.report.read == 6
    monkeypatch.setattr(posttrain.data.io, "PEEK_RECORDS", 12)
    peek = peek_records(str(shards), "sft")
    assert peek.complete and len(peek.records) == 12
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        peek_records(str(tmp_path / "missing.jsonl"), "sft")
    assert peek_records("s3://bucket/train.jsonl", "sft") is None  # remote: left to the one full read
