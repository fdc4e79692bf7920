"""A reduced quickstart recipe (tiny budget) for the end-to-end tests."""

from __future__ import annotations

from pathlib import Path

import yaml

from posttrain.recipes import find_recipe

ROOT = Path(__file__).resolve().parents[2]


def reduced_recipe(run_dir: Path, **changes) -> Path:
    recipe = yaml.safe_load(find_recipe("quickstart").read_text())
    recipe["run_dir"] = str(run_dir)
    recipe["data"] = {"raw_pool": 120, "preamble_share": 0.3, "rl_prompts": 24}
    recipe["base"].update({"hidden_size": 32, "layers": 2, "heads": 2, "kv_heads": 2, "vocab_size": 400,
                           "corpus_documents": 60})
    recipe["base"]["pretrain"]["overrides"] = {"train.max_steps": 3, "train.batch_size": 4, "train.save_every": None,
                                               "train.log_every": 1, "train.warmup_steps": 1}
    recipe["curate"]["overrides"] = {"executor.workers": 0, "intent.enabled": False}
    recipe["sft"]["overrides"].update({"train.max_steps": 4, "train.batch_size": 4, "train.save_every": 2,
                                       "train.log_every": 1, "train.warmup_steps": 1})
    # A barely trained model rarely gets an answer right: any score gap makes a pair here.
    recipe["sample"]["overrides"].update({"sampling.n": 4, "sampling.max_new_tokens": 6, "sampling.batch_size": 32,
                                          "pair_margin": 0.0})
    # A few dozen prompts give a few pairs: below the default dpo.min_pairs, which would skip DPO.
    recipe["dpo"]["overrides"].update({"train.max_steps": 2, "train.batch_size": 2, "train.log_every": 1,
                                       "train.save_every": None, "dpo.min_pairs": 1})
    recipe["eval"] = {"n_per_cell": 2, "max_new_tokens": 6, "batch_size": 32, "n_boot": 200, "n_perm": 200}
    for key, value in changes.items():
        recipe[key] = value
    path = run_dir.parent / f"{run_dir.name}-recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path
