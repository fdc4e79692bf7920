"""`dpo.min_pairs`: DPO over a handful of pairs memorises them, so fewer than the minimum stop the run before
any model loads (exit 2, naming the knobs); lowering it knowingly runs, with the passes over a tiny set capped."""

from __future__ import annotations

from tests.train_preference.conftest import dpo_overrides, preference_rows, read_jsonl, run_cli, write_jsonl


def overrides(model: str, pairs: int, out, tmp_path, **extra) -> list[str]:
    data = {"train": str(write_jsonl(tmp_path / "pairs.jsonl", preference_rows(pairs, seed=8)))}
    items = dpo_overrides(model, data, out, **{"train.max_steps": 80, "dpo.reference_cache_dir": str(tmp_path / "cache"),
                                               **extra})
    if "dpo.min_pairs" not in extra:  # dpo_overrides lowers it for the small sets of other tests; here: the default
        items = [item for item in items if not item.startswith("dpo.min_pairs=")]
    return items


def test_five_pairs_stop_with_exit_2_naming_the_knobs(pref_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_cli("dpo", overrides(pref_model_dir, 5, out, tmp_path)) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # one line, with the count and the knobs
    assert last.startswith("posttrain: ") and "5 preference pairs" in last
    assert "dpo.min_pairs=64" in last and "dpo.min_pairs=5" in last
    assert not (out / "final").exists()


def test_a_lowered_min_pairs_runs_with_the_epochs_over_a_tiny_set_capped(pref_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_cli("dpo", overrides(pref_model_dir, 5, out, tmp_path, **{"dpo.min_pairs": 4})) == 0
    err = capsys.readouterr().err
    # 80 steps of 8 would pass over the 5 pairs 128 times; 4 passes are 20 draws: 2 steps of 8.
    warning = next(line for line in err.splitlines() if "warning:" in line)
    assert "5 pairs" in warning and "128" in warning and "train.max_steps=2" in warning
    steps = [m["step"] for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]
    assert steps == [0, 1] and (out / "final" / "model.safetensors").exists()
