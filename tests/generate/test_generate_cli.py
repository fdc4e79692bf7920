"""`posttrain generate` end to end on the tiny model."""

from __future__ import annotations

import json

from posttrain.cli import main


def test_generate_cli_writes_one_line_per_prompt(tmp_path, tiny_model_dir, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"id": "a", "prompt": "What is 12 plus 30?"}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n"
    )
    out = tmp_path / "out.jsonl"
    code = main(["generate", "--model", tiny_model_dir, "--prompts", str(prompts), "-o", str(out), "--n", "2",
                 "--max-new-tokens", "5", "--temperature", "0.8", "--quiet"])
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "2"]
    assert all(len(r["completions"]) == 2 and r["output"] == r["completions"][0]["text"] for r in rows)
    assert all(c["num_tokens"] <= 5 for r in rows for c in r["completions"])
    assert "tokens/s" in capsys.readouterr().err


def test_generate_cli_reports_bad_lines(tmp_path, tiny_model_dir, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "ok"}) + "\n" + json.dumps({"id": "b", "text": "x"}) + "\n")
    assert main(["generate", "--model", tiny_model_dir, "--prompts", str(prompts), "-o", str(tmp_path / "o")]) == 2
    assert f"{prompts}:2: `prompt`" in capsys.readouterr().err


def test_generate_cli_vllm_without_an_engine_exits_2(tmp_path, tiny_model_dir, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    code = main(["generate", "--model", tiny_model_dir, "--prompts", str(prompts), "-o", str(tmp_path / "o"),
                 "--backend", "vllm", "--engine-python", str(tmp_path / "no-such-python")])
    assert code == 2
    err = capsys.readouterr().err
    assert "--engine-python=" in err and "make vllm-env" in err
    assert main(["generate", "--model", tiny_model_dir, "--prompts", str(prompts), "-o", str(tmp_path / "o"),
                 "--engine-url", "http://127.0.0.1:9"]) == 2
    assert "--engine-url is for --backend vllm" in capsys.readouterr().err


