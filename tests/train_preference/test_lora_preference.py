"""LoRA for DPO and the reward model: the adapter-disabled policy is the reference (no second model), and a
reward model's score head trains in full beside the adapters; the reference pass through the sharded policy
runs on 2 ranks."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from posttrain.config.sections import LoraConfig
from posttrain.data.io import read_records
from posttrain.models.load import load_model, load_tokenizer
from posttrain.models.lora import apply_lora
from posttrain.train.pairs import PairLogprobModel, collate_pairs, model_inputs, split_pairs, tokenize_pairs
from posttrain.train.reference import ReferenceSpec, compute_reference_logps
from tests.train.conftest import ROOT, env
from tests.train_preference.conftest import (
    dpo_overrides,
    preference_rows,
    read_jsonl,
    rm_overrides,
    run_cli,
    write_jsonl,
)

LORA = {"model.lora.r": 4, "model.lora.alpha": 8, "train.lr": 5e-3}


def test_the_adapter_disabled_policy_gives_the_frozen_base_reference(pref_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(11, seed=3))  # 11 pairs: a short last batch
    records, _ = read_records(str(data), kind="preference", progress=False)
    pairs = tokenize_pairs(records, load_tokenizer(pref_model_dir), 64, "left").pairs
    spec = ReferenceSpec(path=pref_model_dir, batch_size=4)
    base_chosen, base_rejected = compute_reference_logps(spec, pairs, 0)  # the base, loaded on its own

    lm = apply_lora(load_model(pref_model_dir), LoraConfig(r=4, alpha=8))
    with torch.no_grad():
        for name, param in lm.named_parameters():
            if ".lora_B." in name:  # B starts at zero; a trained adapter does not
                param.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
    policy = PairLogprobModel(lm)
    chosen, rejected = compute_reference_logps(spec, pairs, 0, policy=policy)
    assert torch.equal(chosen, base_chosen) and torch.equal(rejected, base_rejected)
    with torch.no_grad():  # with the adapter on, the same policy computes other numbers
        adapted, _ = split_pairs(policy(**model_inputs(collate_pairs(pairs[:4], 0, True))))
    assert (adapted - base_chosen[:4]).abs().max() > 1e-3
    assert policy.training  # handed back in the mode it came in


def test_dpo_with_lora_loads_no_reference_model(pref_model_dir, pref_data, tmp_path, monkeypatch):
    data = {"train": pref_data["train"]}
    cache = {"dpo.reference_cache_dir": str(tmp_path / "cache"), "train.max_steps": 3}
    full = tmp_path / "full"  # full fine-tuning: the reference is the base, loaded on its own
    assert run_cli("dpo", dpo_overrides(pref_model_dir, data, full, **cache)) == 0

    def no_second_model(*args, **kwargs):
        raise AssertionError("a LoRA run loaded a reference model")

    monkeypatch.setattr("posttrain.train.reference.load_model", no_second_model)
    monkeypatch.setattr("posttrain.train.dpo.load_model", no_second_model)
    runs = {}
    for mode in ("precomputed", "live"):
        out = tmp_path / mode
        assert run_cli("dpo", dpo_overrides(pref_model_dir, data, out, **LORA, **cache, **{"dpo.reference": mode})) == 0
        runs[mode] = [m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]
    # Step 0: B = 0, so the policy is its own reference: every reward is 0 and the loss is log 2.
    assert runs["precomputed"][0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert runs["precomputed"][-1]["kl_to_ref"] != 0.0
    for pre, live in zip(runs["precomputed"], runs["live"], strict=True):
        for key in ("loss", "grad_norm", "rewards/margin", "kl_to_ref"):
            assert pre[key] == pytest.approx(live[key], rel=1e-5, abs=1e-7), key
    # The cached table (pairs.jsonl lists it per pair) is the separately loaded base's, to the last bit.
    base_refs = {row["id"]: (row["ref_chosen_logp"], row["ref_rejected_logp"]) for row in read_jsonl(full / "pairs.jsonl")}
    lora_refs = {row["id"]: (row["ref_chosen_logp"], row["ref_rejected_logp"])
                 for row in read_jsonl(tmp_path / "precomputed" / "pairs.jsonl")}
    assert lora_refs == base_refs
    assert (tmp_path / "precomputed" / "adapter" / "adapter_model.safetensors").exists()


def _score_head(checkpoint, key: str) -> torch.Tensor:
    shape = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata[key].size
    state = {key: torch.zeros(shape)}
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    return state[key]


def test_a_lora_reward_model_trains_its_score_head_in_full(pref_model_dir, pref_data, tmp_path):
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "rm"
    extra = {**LORA, "train.max_steps": 4, "train.save_every": 2}
    assert run_cli("rm", rm_overrides(pref_model_dir, pref_data, out, **extra)) == 0
    key = "model.lm.base_model.model.score.modules_to_save.default.weight"
    keys = list(FileSystemReader(str(out / "checkpoints" / "step-000004")).read_metadata().state_dict_metadata)
    assert key in keys and f"optim.state.{key.removeprefix('model.')}.exp_avg" in keys
    assert all(".lora_" in k or "score.modules_to_save" in k for k in keys if k.startswith("model."))
    early, late = (_score_head(out / "checkpoints" / f"step-00000{s}", key) for s in (2, 4))
    assert not torch.equal(early, late)  # the head moved between the two checkpoints
    final = AutoModelForSequenceClassification.from_pretrained(out / "final", num_labels=1)
    assert torch.equal(final.score.weight.detach(), late)  # and the export carries the trained head
    assert (out / "final" / "posttrain_reward.json").exists()


@pytest.mark.slow
def test_lora_dpo_reference_pass_on_two_ranks_equals_one(pref_model_dir, tmp_path):
    # 17 pairs, 4 per reference batch: rank 0 has 3 batches, rank 1 two and a dummy one (FSDP's collectives).
    data = {"train": str(write_jsonl(tmp_path / "pairs.jsonl", preference_rows(17, seed=4)))}
    common = {"model.lora.r": 4, "model.lora.alpha": 8, "train.max_steps": 2, "train.global_batch_size": 8,
              "train.max_grad_norm": "null", "dpo.reference_batch_size": 4, "data.shuffle": "false"}
    one, two = tmp_path / "one", tmp_path / "two"
    assert run_cli("dpo", dpo_overrides(pref_model_dir, data, one, **common, **{
        "dpo.reference_cache_dir": str(tmp_path / "cache1")})) == 0
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "posttrain",
               "dpo", *dpo_overrides(pref_model_dir, data, two, **common, **{
                   "train.batch_size": 4, "dpo.reference_cache_dir": str(tmp_path / "cache2")})]
    proc = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    refs = {run: {r["id"]: (r["ref_chosen_logp"], r["ref_rejected_logp"]) for r in read_jsonl(run / "pairs.jsonl")}
            for run in (one, two)}
    assert refs[one].keys() == refs[two].keys() and len(refs[one]) == 17
    for pair_id, values in refs[one].items():
        assert refs[two][pair_id] == pytest.approx(values, rel=1e-6), pair_id
    loss = {run: [m["loss"] for m in read_jsonl(run / "metrics.jsonl") if "loss" in m] for run in (one, two)}
    assert loss[two] == pytest.approx(loss[one], rel=1e-5)
