"""The flywheel on a user's own files: raw instruction records, RL prompts, an eval suite and a base model
directory, with nothing from the built-in generator on the way."""

from __future__ import annotations

import json

import yaml

from posttrain.cli import main
from posttrain.data.io import write_jsonl, write_records
from posttrain.tasks.emit import eval_items, rl_prompts
from tests.flywheel.reduced import reduced_recipe


def test_every_stage_reads_the_users_files(tmp_path, tiny_model_dir):
    raw = tmp_path / "my_chats.jsonl"  # a chat format the built-in pool never writes
    write_jsonl(str(raw), [{"messages": [{"role": "user", "content": f"Write the word tree {1 + i % 3} times."},
                                         {"role": "assistant", "content": " ".join(["tree"] * (1 + i % 3))}]}
                           for i in range(40)])
    prompts = tmp_path / "my_prompts.jsonl"
    write_records(str(prompts), rl_prompts(12, seed=9))
    suite = tmp_path / "my_suite.jsonl"
    items = eval_items(1, seed=9)[:6]
    write_jsonl(str(suite), items)
    run_dir = tmp_path / "run"
    recipe = yaml.safe_load(reduced_recipe(run_dir).read_text())
    recipe["data"] = {"raw_pool": str(raw), "rl_prompts": str(prompts)}
    recipe["eval"]["suite"] = str(suite)
    recipe["base"] = {"model": tiny_model_dir}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert main(["flywheel", "--config", str(path)]) == 0

    data = json.loads((run_dir / "data" / "stage.json").read_text())["outputs"]
    assert data["raw"] == str(raw) and data["prompts"] == str(prompts) and data["suite"] == str(suite)
    assert not (run_dir / "data" / "corpus.txt").exists() and not (run_dir / "base" / "pretrain").exists()
    sft = yaml.safe_load((run_dir / "sft" / "config.yaml").read_text())
    assert sft["model"]["path"] == tiny_model_dir
    assert json.loads((run_dir / "curate" / "funnel.json").read_text())["input"] == 40
    results = json.loads((run_dir / "eval_dpo" / "results.json").read_text())
    assert [i["id"] for i in results["items"]] == [i["id"] for i in items]
    assert (run_dir / "report.html").exists()

    # A changed user file re-runs the stages that read it.
    write_jsonl(str(raw), [{"messages": [{"role": "user", "content": "Say hi."},
                                         {"role": "assistant", "content": "hi"}]}] * 3 + [
        {"messages": [{"role": "user", "content": f"Write the word cat {1 + i % 3} times."},
                      {"role": "assistant", "content": " ".join(["cat"] * (1 + i % 3))}]} for i in range(30)])
    assert main(["flywheel", "--config", str(path)]) == 0
    assert json.loads((run_dir / "curate" / "funnel.json").read_text())["input"] == 33


def test_a_missing_user_file_is_one_line_and_exit_2(tmp_path, capsys):
    run_dir = tmp_path / "run"
    recipe = yaml.safe_load(reduced_recipe(run_dir).read_text())
    recipe["data"]["raw_pool"] = str(tmp_path / "nope.jsonl")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert main(["flywheel", "--config", str(path)]) == 2
    assert "nope.jsonl does not exist" in capsys.readouterr().err
