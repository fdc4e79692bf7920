"""`posttrain generate` and `posttrain eval` send the same prompt file to the model as the same text: one default
(the chat template when the model has one), one flag (`--prompt-format chat|raw`), and the first line of stderr
says which was used."""

from __future__ import annotations

import json

import pytest

from posttrain.cli import main
from posttrain.data.chat import render_prompt
from posttrain.data.records import Message

ITEMS = [
    {"id": "plain", "prompt": "What is 2 plus 2?", "verifier": "numeric", "answer": "4"},
    {"id": "chat", "prompt": [{"role": "user", "content": "What is 3 plus 3?"}], "verifier": "numeric", "answer": "6"},
]


@pytest.fixture
def rendered(monkeypatch):
    """The text each prompt was rendered to before it was tokenized for the model, in the order encoded."""
    import posttrain.generate.engine as engine

    seen: list[str] = []
    encode = engine.encode_prompt

    def spy(tokenizer, prompt):
        seen.append(render_prompt(tokenizer, prompt))
        return encode(tokenizer, prompt)

    monkeypatch.setattr(engine, "encode_prompt", spy)
    return seen


def _suite(tmp_path):
    path = tmp_path / "suite.jsonl"
    path.write_text("".join(json.dumps(item) + "\n" for item in ITEMS), encoding="utf-8")
    return path


def _generate(model: str, prompts, out, *flags: str) -> int:
    return main(["generate", "--model", model, "--prompts", str(prompts), "-o", str(out), "--max-new-tokens", "2",
                 "--temperature", "0", "--quiet", *flags])


def _eval(model: str, suite, out, *flags: str) -> int:
    return main(["eval", "--model", model, "--suite", str(suite), "-o", str(out), "--max-new-tokens", "2",
                 "--n-boot", "10", "--quiet", *flags])


def _first_line(err: str) -> str:
    return next(line for line in err.splitlines() if line.strip())


def test_generate_and_eval_render_the_same_prompt_file_the_same_way(tmp_path, tiny_model_dir, tiny_tokenizer,
                                                                    rendered, capsys):
    suite = _suite(tmp_path)
    assert _generate(tiny_model_dir, suite, tmp_path / "gen.jsonl") == 0
    generated, err = list(rendered), capsys.readouterr().err
    assert _first_line(err).startswith("posttrain generate: prompt format: chat")
    rendered.clear()
    assert _eval(tiny_model_dir, suite, tmp_path / "results.json") == 0
    evaluated, err = list(rendered), capsys.readouterr().err
    assert _first_line(err).startswith("posttrain eval: prompt format: chat")

    # The default is the chat template (the tiny model has one): a string prompt is one user turn.
    templated = render_prompt(tiny_tokenizer, [Message(role="user", content="What is 2 plus 2?")])
    assert templated != "What is 2 plus 2?"
    assert generated[0] == evaluated[0] == templated
    assert sorted(generated) == sorted(evaluated)
    assert json.loads((tmp_path / "results.json").read_text())["config"]["prompt_format"] == "chat"


def test_prompt_format_raw_sends_string_prompts_as_written_on_both(tmp_path, tiny_model_dir, tiny_tokenizer,
                                                                   rendered, capsys):
    suite = _suite(tmp_path)
    assert _generate(tiny_model_dir, suite, tmp_path / "gen.jsonl", "--prompt-format", "raw") == 0
    generated, err = list(rendered), capsys.readouterr().err
    assert _first_line(err).startswith("posttrain generate: prompt format: raw")
    rendered.clear()
    assert _eval(tiny_model_dir, suite, tmp_path / "results.json", "--prompt-format", "raw") == 0
    evaluated, err = list(rendered), capsys.readouterr().err
    assert _first_line(err).startswith("posttrain eval: prompt format: raw")

    assert generated[0] == evaluated[0] == "What is 2 plus 2?"
    # A chat has no text "as written": it keeps the template on both commands.
    chat = render_prompt(tiny_tokenizer, [Message(role="user", content="What is 3 plus 3?")])
    assert generated[1] == evaluated[1] == chat
    assert json.loads((tmp_path / "results.json").read_text())["config"]["prompt_format"] == "raw"


class _Tokenizer:
    def __init__(self, template):
        self.chat_template = template


def test_auto_is_chat_only_when_the_tokenizer_has_a_template():
    from posttrain.generate.prompts import apply_prompt_format, resolve_prompt_format

    assert resolve_prompt_format("auto", _Tokenizer("{{ messages }}")) == "chat"
    assert resolve_prompt_format("auto", _Tokenizer(None)) == "raw"
    assert resolve_prompt_format("raw", _Tokenizer("{{ messages }}")) == "raw"
    with pytest.raises(ValueError, match="--prompt-format raw"):
        resolve_prompt_format("chat", _Tokenizer(None))
    chat = [Message(role="user", content="b")]
    assert apply_prompt_format(["a", chat], "chat") == [[Message(role="user", content="a")], chat]
    assert apply_prompt_format(["a", chat], "raw") == ["a", chat]


def test_eval_refuses_a_prompt_format_for_given_outputs(tmp_path, capsys):
    suite = _suite(tmp_path)
    outputs = tmp_path / "o.jsonl"
    outputs.write_text(json.dumps({"id": "plain", "output": "4"}) + "\n" + json.dumps({"id": "chat", "output": "6"})
                       + "\n", encoding="utf-8")
    assert main(["eval", "--outputs", str(outputs), "--suite", str(suite), "--prompt-format", "raw", "--quiet"]) == 2
    assert "--prompt-format" in capsys.readouterr().err


def test_the_old_flags_still_mean_the_same_thing():
    """Scripts written before --prompt-format keep working: generate's --chat and eval's --raw-prompts."""
    from posttrain.cli import build_parser

    parser = build_parser()
    generate = parser.parse_args(["generate", "--model", "m", "--prompts", "p", "-o", "o", "--chat"])
    evaluate = parser.parse_args(["eval", "--model", "m", "--suite", "s", "--raw-prompts"])
    assert (generate.prompt_format, evaluate.prompt_format) == ("chat", "raw")
    assert parser.parse_args(["eval", "--model", "m", "--suite", "s"]).prompt_format == "auto"
