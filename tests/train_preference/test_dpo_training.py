"""DPO end to end on a tiny model: every loss moves the margin the right way, training learns a held-out
preference, metrics and pair records are written, and the exported model loads."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.algorithms.preference import LOSS_SPECS, LOSSES
from posttrain.config import load_config
from posttrain.config.preference import DPORecipe
from posttrain.data.io import read_records
from posttrain.models.load import load_model, load_tokenizer
from posttrain.train.dpo import METRIC_KEYS, ReferenceLogps, pair_losses
from posttrain.train.pairs import PairLogprobModel, collate_pairs, model_inputs, split_pairs, tokenize_pairs
from tests.train_preference.conftest import dpo_overrides, read_jsonl, run_cli

LOSS_OPTIONS = {"simpo": ["dpo.beta=2.0"], "orpo": [], "cdpo": ["dpo.label_smoothing=0.1"],
                "robust": ["dpo.label_smoothing=0.1"]}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_one_step_of_each_loss_widens_the_margin_on_its_batch(name, pref_model_dir, pref_data):
    config = load_config(DPORecipe, None, [
        "output_dir=/tmp/unused", f"model.path={pref_model_dir}", f"data.train={pref_data['train']}",
        f"dpo.loss={name}", *LOSS_OPTIONS.get(name, []),
    ])
    tokenizer = load_tokenizer(pref_model_dir)
    records, _ = read_records(pref_data["train"], kind="preference", progress=False)
    pairs = tokenize_pairs(records[:8], tokenizer, 64, "left").pairs
    root = PairLogprobModel(load_model(pref_model_dir))
    batch = collate_pairs(pairs, tokenizer.pad_token_id, True)
    with torch.no_grad():
        start = split_pairs(root(**model_inputs(batch)))
    reference = ReferenceLogps(table=start) if LOSS_SPECS[name].needs_reference else ReferenceLogps()
    reference.attach(batch)
    batch["bco_delta"] = 0.0

    @torch.no_grad()
    def margin() -> float:
        chosen, rejected = split_pairs(root(**model_inputs(batch)))
        lengths_c, lengths_r = batch["chosen_lengths"], batch["rejected_lengths"]
        if LOSS_SPECS[name].needs_lengths:  # the length-normalised losses widen the per-token margin
            return float((chosen / lengths_c - rejected / lengths_r).mean())
        return float((chosen - rejected).mean())

    before = margin()
    optimizer = torch.optim.SGD(root.parameters(), lr=0.05)
    per_pair, _, _ = pair_losses(config, batch, root(**model_inputs(batch)))
    per_pair.mean().backward()
    optimizer.step()
    assert margin() > before


def test_dpo_learns_a_held_out_preference(pref_model_dir, pref_data, tmp_path):
    out = tmp_path / "dpo"
    # The gradient norm jumps (about 0.3 → 3 here) when the pairs start to separate: the default health
    # guard (a ratio to the recent maximum) must let those learning steps through (checked below).
    extra = {"train.max_steps": 64, "train.lr": 2e-3, "train.save_every": 32, "dpo.sft_weight": 0.1}
    assert run_cli("dpo", dpo_overrides(pref_model_dir, pref_data, out, **extra)) == 0
    result = json.loads((out / "eval.json").read_text())
    before, after = result["before"], result["after"]
    # The base model has no idea which prompt wants which kind of word: a coin flip.
    assert 0.3 <= before["logps_accuracy"] <= 0.7
    # Policy == reference: every implicit reward is 0 up to float noise between batchings (ties count wrong).
    assert before["rewards/accuracy"] <= 0.1
    assert after["rewards/accuracy"] >= 0.9
    assert after["logps_accuracy"] >= 0.85 and after["loss"] < before["loss"] - 0.3
    assert after["pairs"] == 64

    steps = [m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]
    assert len(steps) == 64 and not any(m["skipped"] for m in steps)  # the learning phase is not a "spike"
    for key in (*METRIC_KEYS, "loss/sft", "grad_norm", "tokens_per_s"):
        assert all(key in m for m in steps), key
    assert all(0.0 <= m["rewards/accuracy"] <= 1.0 for m in steps)
    assert sum(m["rewards/accuracy"] for m in steps[-10:]) / 10 > 0.8
    evals = [m for m in read_jsonl(out / "metrics.jsonl") if "eval_phase" in m]
    assert [m["eval_phase"] for m in evals] == ["before_training", "after_training"]

    # Every pair used is listed with its rationale verbatim and its reference log-probs.
    source = {r.id: r for r in read_records(pref_data["train"], kind="preference", progress=False)[0]}
    listed = read_jsonl(out / "pairs.jsonl")
    assert len(listed) == len(source) == 192
    for row in listed:
        assert row["rationale"] == source[row["id"]].rationale
        assert (row["chosen_score"], row["rejected_score"]) == (9.0, 2.0)
        assert row["ref_chosen_logp"] < 0 and row["uses"] in (2, 3)
    assert sum(row["uses"] for row in listed) == 64 * 8

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.num_hidden_layers == 2


def test_reference_free_loss_runs_without_any_reference(pref_model_dir, pref_data, tmp_path):
    out = tmp_path / "simpo"
    extra = {"dpo.loss": "simpo", "dpo.beta": 2.0, "dpo.simpo_gamma": 0.5, "train.max_steps": 3}
    assert run_cli("dpo", dpo_overrides(pref_model_dir, {"train": pref_data["train"]}, out, **extra)) == 0
    steps = [m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]
    assert len(steps) == 3 and all("kl_to_ref" not in m for m in steps)
    assert "ref_chosen_logp" not in read_jsonl(out / "pairs.jsonl")[0]


def test_bco_running_delta_is_checkpointed(pref_model_dir, pref_data, tmp_path):
    out = tmp_path / "bco"
    extra = {"dpo.loss": "bco_pair", "train.max_steps": 2, "train.save_every": 1}
    assert run_cli("dpo", dpo_overrides(pref_model_dir, {"train": pref_data["train"]}, out, **extra)) == 0
    saved = json.loads((out / "checkpoints" / "step-000002" / "trainer.json").read_text())["source"]
    assert saved["bco_count"] == 2 * 2 * 8  # chosen and rejected rewards of 2 steps of 8 pairs
    assert saved["bco_mean"] != 0.0
