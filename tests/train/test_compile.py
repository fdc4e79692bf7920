"""``train.compile: true`` compiles each decoder block and trains to the same losses as eager (fp32)."""

from __future__ import annotations

import pytest

from tests.conftest import CHAT_TEXTS
from tests.train.conftest import base_overrides, read_jsonl, run_in_process


@pytest.fixture(scope="module")
def one_layer_model(tmp_path_factory) -> str:
    """One block keeps inductor's CPU compile (a C++ build with gcc) to a few seconds."""
    from posttrain.models.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("tiny1") / "model"
    return str(build_tiny_model(path, texts=CHAT_TEXTS, vocab_size=400, num_layers=1, seed=0))


def test_compiled_blocks_give_the_eager_losses(one_layer_model, sft_data, tmp_path, capsys):
    common = {"train.max_steps": 3, "train.batch_size": 4, "data.shuffle": "false", "train.precision": "fp32"}
    runs = {}
    for compiled in ("false", "true"):
        out = tmp_path / f"compile-{compiled}"
        assert run_in_process(base_overrides(one_layer_model, sft_data, out, **common,
                                             **{"train.compile": compiled})) == 0
        runs[compiled] = [m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]
    assert "'compiled_blocks': 1" in capsys.readouterr().err  # the block really went through torch.compile
    eager, compiled = runs["false"], runs["true"]
    assert len(eager) == len(compiled) == 3
    for a, b in zip(eager, compiled, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5, rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
