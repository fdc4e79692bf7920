"""Reference log-probs: precomputed == live, the cache is reused and invalidated, the model is freed."""

from __future__ import annotations

import gc
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from posttrain.data.io import read_records
from posttrain.models.load import load_tokenizer
from posttrain.train.pairs import tokenize_pairs
from posttrain.train.reference import ReferenceSpec, compute_reference_logps, reference_logps
from tests.train_preference.conftest import dpo_overrides, preference_rows, read_jsonl, run_cli, write_jsonl


def test_precomputed_and_live_reference_give_the_same_training_run(pref_model_dir, pref_data, tmp_path):
    runs = {}
    for mode in ("precomputed", "live"):
        out = tmp_path / mode
        data = {"train": pref_data["train"]}
        extra = {"dpo.reference": mode, "train.max_steps": 3, "dpo.reference_cache_dir": str(tmp_path / "cache")}
        assert run_cli("dpo", dpo_overrides(pref_model_dir, data, out, **extra)) == 0
        runs[mode] = [m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]
    assert len(runs["precomputed"]) == len(runs["live"]) == 3
    for pre, live in zip(runs["precomputed"], runs["live"], strict=True):
        for key in ("loss", "grad_norm", "rewards/chosen", "rewards/margin", "kl_to_ref", "logps/rejected"):
            assert pre[key] == pytest.approx(live[key], rel=1e-5, abs=1e-6), key
    # Step 0: the policy is the reference, so every reward is 0 and the loss is log 2.
    assert runs["precomputed"][0]["loss"] == pytest.approx(0.693147, abs=1e-5)
    assert runs["precomputed"][0]["rewards/margin"] == pytest.approx(0.0, abs=1e-5)
    assert runs["precomputed"][1]["kl_to_ref"] != 0.0  # the policy moved away from the reference


def _pairs(model_dir: str, data_path: str):
    records, _ = read_records(data_path, kind="preference", progress=False)
    return tokenize_pairs(records, load_tokenizer(model_dir), 64, "left").pairs


def test_cache_is_reused_and_invalidated_by_model_or_data_changes(pref_model_dir, tmp_path):
    data_path = str(write_jsonl(tmp_path / "data" / "pairs.jsonl", preference_rows(24, seed=5)))
    spec = ReferenceSpec(path=pref_model_dir, batch_size=8)
    pairs = _pairs(pref_model_dir, data_path)
    cache = tmp_path / "data" / ".posttrain_ref_cache"
    first = reference_logps(spec, pairs, 0, data_path, cache)
    assert not first.reused and first.path.parent == cache and first.path.exists()
    again = reference_logps(spec, pairs, 0, data_path, cache)
    assert again.reused and again.path == first.path
    assert torch.equal(again.chosen, first.chosen) and torch.equal(again.rejected, first.rejected)

    # Another model: copy the directory and nudge one weight.
    other_model = tmp_path / "other-model"
    shutil.copytree(pref_model_dir, other_model)
    weights = load_file(str(other_model / "model.safetensors"))
    name = next(k for k in weights if k.endswith("norm.weight"))
    weights[name] = weights[name] * 1.01
    save_file(weights, str(other_model / "model.safetensors"), metadata={"format": "pt"})
    changed_model = reference_logps(ReferenceSpec(path=str(other_model), batch_size=8), pairs, 0, data_path, cache)
    assert not changed_model.reused and changed_model.path != first.path
    assert not torch.equal(changed_model.chosen, first.chosen)

    # Other data: one more pair in the file.
    write_jsonl(tmp_path / "data" / "pairs.jsonl", preference_rows(25, seed=5))
    more = _pairs(pref_model_dir, data_path)
    changed_data = reference_logps(spec, more, 0, data_path, cache)
    assert not changed_data.reused and changed_data.path not in (first.path, changed_model.path)
    torch.testing.assert_close(changed_data.chosen[:24], first.chosen, rtol=1e-5, atol=1e-5)

    # Other settings that change the numbers (here: the prompt cut) also get their own file.
    short = tokenize_pairs(read_records(data_path, kind="preference", progress=False)[0],
                           load_tokenizer(pref_model_dir), 20, "left").pairs
    assert not reference_logps(spec, short, 0, data_path, cache).reused
    assert len(list(cache.glob("*.safetensors"))) == 4


def test_a_corrupt_or_foreign_cache_file_is_not_trusted(pref_model_dir, tmp_path):
    data_path = str(write_jsonl(tmp_path / "pairs.jsonl", preference_rows(8, seed=6)))
    spec = ReferenceSpec(path=pref_model_dir)
    pairs = _pairs(pref_model_dir, data_path)
    first = reference_logps(spec, pairs, 0, data_path, tmp_path / "cache")
    save_file({"chosen": torch.zeros(8), "rejected": torch.zeros(8)}, str(first.path), metadata={"key": "other"})
    with pytest.warns(UserWarning, match="does not match its manifest"):
        redone = reference_logps(spec, pairs, 0, data_path, tmp_path / "cache")
    assert not redone.reused
    torch.testing.assert_close(redone.chosen, first.chosen)


def test_a_cache_overwritten_with_zeros_under_its_own_header_is_recomputed(pref_model_dir, pref_data, tmp_path):
    """The failure seen before the manifest: the file's header (key, pair count) intact, its numbers zeroed,
    and the zeros "reused" — DPO's step-0 loss was 36.96 instead of ln 2."""
    cache = tmp_path / "cache"
    extra = {"train.max_steps": 1, "dpo.reference_cache_dir": str(cache)}
    data = {"train": pref_data["train"]}
    assert run_cli("dpo", dpo_overrides(pref_model_dir, data, tmp_path / "first", **extra)) == 0
    [cached] = cache.glob("*.safetensors")
    header_length = 8 + int.from_bytes(cached.read_bytes()[:8], "little")
    raw = cached.read_bytes()
    cached.write_bytes(raw[:header_length] + bytes(len(raw) - header_length))  # same header, zeroed numbers
    with pytest.warns(UserWarning, match="does not match its manifest"):
        assert run_cli("dpo", dpo_overrides(pref_model_dir, data, tmp_path / "second", **extra)) == 0
    [step0] = [m for m in read_jsonl(tmp_path / "second" / "metrics.jsonl") if "loss" in m]
    assert step0["loss"] == pytest.approx(0.693147, abs=1e-4)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # gc.get_objects() touches deprecated torch aliases
def test_the_reference_model_is_freed_after_the_pass(pref_model_dir, tmp_path):
    data_path = str(write_jsonl(tmp_path / "pairs.jsonl", preference_rows(8, seed=7)))
    pairs = _pairs(pref_model_dir, data_path)
    gc.collect()
    before = sum(isinstance(o, PreTrainedModel) for o in gc.get_objects())
    chosen, rejected = compute_reference_logps(ReferenceSpec(path=pref_model_dir), pairs, 0)
    gc.collect()
    assert sum(isinstance(o, PreTrainedModel) for o in gc.get_objects()) == before
    assert chosen.shape == rejected.shape == (8,) and bool((chosen < 0).all())


def test_the_default_cache_is_under_xdg_cache_home_and_reused_by_another_run(pref_model_dir, tmp_path, monkeypatch):
    cache_home = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))
    data_dir = tmp_path / "data"
    data = {"train": str(write_jsonl(data_dir / "pairs.jsonl", preference_rows(16, seed=3)))}
    extra = {"train.max_steps": 1}
    assert run_cli("dpo", dpo_overrides(pref_model_dir, data, tmp_path / "first", **extra)) == 0
    cached = list((cache_home / "posttrain" / "reference").glob("pairs.jsonl.*.safetensors"))
    assert len(cached) == 1
    assert sorted(p.name for p in data_dir.iterdir()) == ["pairs.jsonl"]  # nothing written beside the data
    before = cached[0].stat().st_mtime_ns
    assert run_cli("dpo", dpo_overrides(pref_model_dir, data, tmp_path / "second", **extra)) == 0
    assert cached[0].stat().st_mtime_ns == before  # reused, not recomputed


def test_the_reference_free_losses_run_from_the_shipped_recipe(pref_model_dir, pref_data, tmp_path):
    from tests.train.conftest import ROOT

    recipe = str(ROOT / "posttrain" / "recipes" / "dpo_tiny.yaml")
    for loss in ("simpo", "orpo", "ipo"):
        overrides = dpo_overrides(pref_model_dir, {"train": pref_data["train"]}, tmp_path / loss,
                                  **{"train.max_steps": 1, "dpo.loss": loss})
        from posttrain.cli import main

        assert main(["dpo", "--config", recipe, *overrides, "data.eval=null"]) == 0, loss
