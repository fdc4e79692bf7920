"""Executors give the same results in shard order: in-process, process pool, Ray Data."""

from __future__ import annotations

import importlib.util

import pytest

from posttrain.curate.config import ExecutorConfig
from posttrain.curate.executor import import_ray, run_tasks
from posttrain.curate.pipeline import curate

from .conftest import make_config


def square(x: int) -> int:
    return x * x


def test_local_pool_keeps_shard_order():
    tasks = list(range(7))
    pooled = run_tasks(square, tasks, ExecutorConfig(workers=2), "t", progress=False)
    assert pooled == run_tasks(square, tasks, ExecutorConfig(workers=0), "t", progress=False) == [x * x for x in tasks]


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="ray is installed")
def test_ray_missing_says_how_to_install():
    with pytest.raises(ImportError, match=r"pip install 'posttrain\[ray\]'"):
        import_ray()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside Ray Data's own context setup
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray not installed")
def test_ray_data_executor_matches_inline(raw_pool_file, tmp_path):
    ray = import_ray()
    try:
        inline = curate(make_config(raw_pool_file, tmp_path / "inline", "executor.shard_size=80"))
        on_ray = curate(make_config(raw_pool_file, tmp_path / "ray", "executor.shard_size=80", "executor.kind=ray",
                                    "executor.workers=2"))  # fmt: skip
    finally:
        ray.shutdown()
    assert on_ray["content_hash"] == inline["content_hash"] and on_ray["funnel"] == inline["funnel"]
