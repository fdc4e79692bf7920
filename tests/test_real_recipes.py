"""The recipes for real hub models (``posttrain/recipes/real/``) are found by name, ship in the package, validate,
and run two steps each on a tiny random model of the same architecture (Qwen3 with its decoupled head_dim and tied
embeddings; Llama with tied embeddings) and chat-template family, reading tiny data files laid out where the
recipe's own ``data.train`` looks (the hub's parquet shards, Alpaca's JSON array, GSM8K converted by
``python -m posttrain.recipes.real.gsm8k``). Only ``model.path`` and sizes are overridden."""

from __future__ import annotations

import fnmatch
import json
import tomllib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from posttrain.cli import main
from posttrain.recipes import RECIPES_DIR, find_recipe, packaged_recipes
from posttrain.recipes.real import gsm8k
from tests.data.templates import FAMILIES, family_tokenizer

ROOT = Path(__file__).resolve().parents[1]
REAL = {  # name -> (kind, architecture of the tiny stand-in)
    "real/qwen3_0.6b_sft": ("sft", "qwen3"),
    "real/qwen3_0.6b_dpo": ("dpo", "qwen3"),
    "real/qwen3_0.6b_grpo_gsm8k": ("grpo", "qwen3"),
    "real/llama3.2_1b_sft": ("sft", "llama"),
}
HUB_MODELS = {"qwen3": "Qwen/Qwen3-0.6B", "llama": "meta-llama/Llama-3.2-1B-Instruct"}
# What each recipe's two steps shrink (everything else is the recipe as shipped).
SMALL = {
    "sft": {"train.global_batch_size": 2, "train.batch_size": 2, "train.max_length": 192},
    "dpo": {"train.global_batch_size": 2, "train.batch_size": 2, "train.max_length": 64, "dpo.min_pairs": 2},
    "grpo": {"train.global_batch_size": 2, "train.batch_size": 10, "train.max_length": 192, "rl.max_new_tokens": 6,
             "rl.rollout_batch_size": 10, "reward.workers": 0},
}
CHATS = [[{"role": "user", "content": f"What is {a} plus {b}?"}, {"role": "assistant", "content": f"It is {a + b}."}]
         for a, b in [(12, 30), (17, 71), (3, 1), (5, 8), (40, 2), (9, 9)]]


def build_tiny(arch: str, path: Path) -> str:
    """A 2-layer random model of ``arch`` with its family's chat template, shaped like the real one where it matters:
    tied embeddings (both), and for Qwen3 a head_dim that is not hidden/heads (Qwen3-0.6B: 16 x 128 over 1024)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from posttrain.models.tiny import tiny_llama_config

    tokenizer = family_tokenizer(FAMILIES["qwen3" if arch == "qwen3" else "llama3"])
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    if arch == "qwen3":
        config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                             max_position_embeddings=2048, **ids)
        model = Qwen3ForCausalLM(config)
    else:
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(tiny_llama_config(len(tokenizer), tie_word_embeddings=True, **ids))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("real-tiny")
    return {arch: build_tiny(arch, root / arch) for arch in HUB_MODELS}


def write_hub_data(root: Path) -> None:
    """Tiny files in the hub's own layouts, where the recipes' data.train / data.eval point (relative to ``root``)."""
    capybara = root / "data/capybara/data"
    capybara.mkdir(parents=True)
    for split, chats in (("train", CHATS), ("test", CHATS[:2])):
        pq.write_table(pa.Table.from_pylist([{"source": "tiny", "messages": chat} for chat in chats]),
                       capybara / f"{split}-00000-of-00001.parquet")
    ultrafeedback = root / "data/ultrafeedback/data"
    ultrafeedback.mkdir(parents=True)
    pairs = [{"chosen": chat, "rejected": [chat[0], {"role": "assistant", "content": "I do not know."}],
              "score_chosen": 8.0, "score_rejected": 3.0} for chat in CHATS]
    for split, rows in (("train", pairs), ("test", pairs[:2])):
        pq.write_table(pa.Table.from_pylist(rows), ultrafeedback / f"{split}-00000-of-00001.parquet")
    alpaca = root / "data/alpaca-cleaned"
    alpaca.mkdir(parents=True)
    rows = [{"instruction": chat[0]["content"], "input": "", "output": chat[1]["content"]} for chat in CHATS]
    rows[0]["input"] = "Show the sum."
    (alpaca / "alpaca_data_cleaned.json").write_text(json.dumps(rows, indent=2))
    gsm = root / "data/gsm8k/main"
    gsm.mkdir(parents=True)
    problems = [{"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
                 "answer": f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b:,}"}
                for a, b in [(12, 30), (17, 71), (3, 1), (999, 1)]]
    pq.write_table(pa.Table.from_pylist(problems), gsm / "train-00000-of-00001.parquet")
    assert gsm8k.main([str(gsm / "train-00000-of-00001.parquet"), str(root / "data/gsm8k/train.jsonl")]) == 0


@pytest.fixture(scope="module")
def hub_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("real-data")
    write_hub_data(root)
    return root


def test_each_real_recipe_is_packaged_and_found_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = packaged_recipes()
    assert set(REAL) <= set(names)
    for name, (kind, arch) in REAL.items():
        path = RECIPES_DIR / f"{name}.yaml"
        for spelling in (name, f"{name}.yaml", f"recipes/{name}.yaml"):
            assert find_recipe(spelling) == path == names[name]
        recipe = yaml.safe_load(path.read_text())
        assert recipe["recipe"] == kind and recipe["model"]["path"] == HUB_MODELS[arch]
        text = path.read_text()
        assert "Expected result:" in text and "Hyperparameters:" in text and "Hardware:" in text, name
    with pytest.raises(FileNotFoundError, match="did you mean `real/qwen3_0.6b_sft`"):
        find_recipe("real/qwen3_0.6b_stf")
    # a wheel carries them: pyproject's package data matches every file (what tests/test_wheel_install.py builds)
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for path in (RECIPES_DIR / "real").iterdir():
        if path.suffix == ".yaml":
            relative = path.relative_to(RECIPES_DIR).as_posix()
            assert any(fnmatch.fnmatch(relative, pattern) for pattern in package_data["posttrain.recipes"]), relative


def test_recipes_list_shows_them(capsys):
    assert main(["recipes", "list"]) == 0
    out = capsys.readouterr().out
    for name, (kind, _) in REAL.items():
        line = next(line for line in out.splitlines() if line.split()[:1] == [name])
        assert line.split()[1] == kind, line


def test_gsm8k_conversion_keeps_the_final_number_and_refuses_a_row_without_one(hub_data, tiny_models, tmp_path,
                                                                              capsys):
    converted = hub_data / "data/gsm8k/train.jsonl"
    prompts = [json.loads(line) for line in converted.read_text().splitlines()]
    assert [p["answer"] for p in prompts] == ["42", "88", "4", "1000"]  # "#### 1,000" -> "1000"
    assert [p["id"] for p in prompts] == [f"gsm8k-train-{i}" for i in range(1, 5)]
    assert all(p["verifier"] == "numeric" and p["prompt"].endswith(gsm8k.INSTRUCTION) for p in prompts)
    assert prompts[0]["meta"]["solution"].endswith("#### 42")
    # the converted file is also the eval suite the recipe's comment scores the test split with
    results = tmp_path / "results.json"
    assert main(["eval", "--model", tiny_models["qwen3"], "--suite", str(converted), "--max-new-tokens", "4",
                 "-o", str(results), "--quiet"]) == 0
    assert results.is_file()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "How many?", "answer": "No final line."}) + "\n")
    assert gsm8k.main([str(bad), str(tmp_path / "out.jsonl")]) == 2
    assert "bad.jsonl:1: `answer` does not end in `#### <number>`" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(REAL))
def test_validate_then_two_steps_on_a_tiny_model_of_the_same_architecture(name, tiny_models, hub_data, tmp_path,
                                                                       monkeypatch, capsys):
    kind, arch = REAL[name]
    monkeypatch.chdir(hub_data)  # the recipe's own relative data paths
    out = tmp_path / "run"
    overrides = [f"model.path={tiny_models[arch]}", f"output_dir={out}", "metrics.tensorboard=false",
                 "train.epochs=null", "train.max_steps=2", "train.save_every=null", "train.eval_every=null",
                 *(f"{key}={value}" for key, value in SMALL[kind].items())]
    assert main(["validate", "--config", name, "--quiet", f"model.path={tiny_models[arch]}"]) == 0
    assert main([kind, "--config", name, *overrides]) == 0, capsys.readouterr().err[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "loss" in r] == [0, 1]
    assert (out / "final" / "model.safetensors").is_file()
    assert json.loads((out / "finished.json").read_text())["steps"] == 2
