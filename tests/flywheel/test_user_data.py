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


def test_a_second_round_on_the_users_files(tmp_path, tiny_model_dir):
    """Round 2 reads the user's next pool, RL prompts and dev suite; the dev suite's failures go through
    the service, and the eval is round 1's (the user's) suite."""
    raw, raw2 = tmp_path / "pool1.jsonl", tmp_path / "pool2.jsonl"
    for path, word in ((raw, "tree"), (raw2, "lamp")):
        write_jsonl(str(path), [{"prompt": f"Write the word {word} {1 + i % 3} times.",
                                 "response": " ".join([word] * (1 + i % 3))} for i in range(30)])
    prompts, prompts2 = tmp_path / "p1.jsonl", tmp_path / "p2.jsonl"
    write_records(str(prompts), rl_prompts(8, seed=1))
    write_records(str(prompts2), rl_prompts(24, seed=2))
    suite, dev = tmp_path / "suite.jsonl", tmp_path / "dev.jsonl"
    write_jsonl(str(suite), eval_items(1, seed=9)[:6])
    dev_items = eval_items(1, seed=4, split="train")[:5]
    for item in dev_items[::2]:  # some dev prompts as chats: capture and the annotator's answer keys handle both
        item["prompt"] = [{"role": "user", "content": item["prompt"]}]
    write_jsonl(str(dev), dev_items)
    run_dir = tmp_path / "run"
    recipe = yaml.safe_load(reduced_recipe(run_dir).read_text())
    recipe.update(rounds=2, data={"raw_pool": str(raw), "rl_prompts": str(prompts)}, base={"model": tiny_model_dir},
                  feedback={"dev_suite": str(dev), "samples": 2, "max_new_tokens": 6},
                  next_round={"raw_pool": str(raw2), "rl_prompts": str(prompts2), "model_judge": False,
                              "curate": {"intent.enabled": False}, "sft": {"train.max_steps": 2},
                              "dpo": {"train.max_steps": 1}})
    recipe["eval"]["suite"] = str(suite)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert main(["flywheel", "--config", str(path)]) == 0
    data = json.loads((run_dir / "round2" / "data" / "stage.json").read_text())["outputs"]
    assert data == {"raw": str(raw2), "prompts": str(prompts2), "dev_suite": str(dev)}
    dev_results = json.loads((run_dir / "round2" / "capture" / "results.json").read_text())
    assert [i["id"] for i in dev_results["items"]] == [i["id"] for i in dev_items]
    annotate = json.loads((run_dir / "round2" / "annotate" / "stage.json").read_text())["outputs"]
    capture = json.loads((run_dir / "round2" / "capture" / "stage.json").read_text())["outputs"]
    assert annotate["votes"] == capture.get("alternatives", 0) and "no_key" not in annotate
    assert json.loads((run_dir / "round2" / "curate" / "funnel.json").read_text())["input"] == 30
    later = json.loads((run_dir / "round2" / "eval_dpo" / "results.json").read_text())
    assert len(later["items"]) == 6
    assert json.loads((run_dir / "rounds.json").read_text())["rounds"][1]["start"] == "round1/dpo"


def test_a_missing_user_file_is_one_line_and_exit_2(tmp_path, capsys):
    run_dir = tmp_path / "run"
    recipe = yaml.safe_load(reduced_recipe(run_dir).read_text())
    recipe["data"]["raw_pool"] = str(tmp_path / "nope.jsonl")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert main(["flywheel", "--config", str(path)]) == 2
    assert "nope.jsonl does not exist" in capsys.readouterr().err


def test_no_preference_pairs_skip_dpo_with_what_to_change(tmp_path):
    """Zero pairs (an empty or missing file) no longer stop the round: the DPO stage records why it did not train."""
    from posttrain.flywheel.config import StageRecipe
    from posttrain.flywheel.run import stage_dpo

    empty = tmp_path / "preferences.jsonl"
    empty.write_text("\n")
    stage = StageRecipe(recipe="dpo_tiny", overrides={"dpo": {"min_pairs": 2}})
    for path in (empty, tmp_path / "missing.jsonl"):
        out = tmp_path / "dpo"
        out.mkdir(exist_ok=True)
        outputs = stage_dpo(stage, {"data.train": str(path)}, out, ("raise next_round.rl_prompts", "unused"))
        assert outputs["pairs"] == 0 and outputs["min_pairs"] == 2
        assert outputs["skipped"] == "DPO skipped: 0 pairs, fewer than dpo.min_pairs=2; raise next_round.rl_prompts"
        assert not (out / "config.yaml").exists()  # DPO never started
