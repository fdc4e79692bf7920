"""Run the same shard function over many shards: in this process, in a local process pool, or on Ray.

Results come back in shard order whatever order the shards finish in, so the output of a run does
not depend on the executor or the number of workers.

- ``workers == 0``: in this process (debugging; also used for segments that load large models).
- ``local``: ``concurrent.futures.ProcessPoolExecutor`` with the ``spawn`` start method (safe with
  torch and tokenizers threads); at most ``workers`` shards are in memory at once.
- ``ray``: Ray Data (``ray.data.from_items(...).map(...)``) on the cluster at ``ray_address`` or a
  local Ray instance. Inputs and ``output_dir`` must be on a filesystem every node can read.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

from posttrain.curate.config import ExecutorConfig
from posttrain.progress import progress as progress_bar


def run_tasks(
    fn: Callable[[Any], Any],
    tasks: Sequence[Any],
    config: ExecutorConfig,
    desc: str,
    progress: bool = True,
    inline: bool = False,
) -> list[Any]:
    """``[fn(task) for task in tasks]``, possibly in parallel, with a progress bar over tasks."""
    if not tasks:
        return []
    if inline or config.workers == 0:
        return [fn(task) for task in progress_bar(tasks, desc=desc, unit="shard", disable=not progress)]
    if config.kind == "ray":
        return _run_ray(fn, tasks, config, desc, progress)
    # Imported here: 30-60 ms of start-up that a run in this process (workers: 0) does not need.
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    results: list[Any] = [None] * len(tasks)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(config.workers, len(tasks)), mp_context=context) as pool:
        futures = {pool.submit(fn, task): position for position, task in enumerate(tasks)}
        with progress_bar(total=len(tasks), desc=desc, unit="shard", disable=not progress) as bar:
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                bar.update(1)
    return results


def import_ray() -> Any:
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise ImportError(
            "executor.kind=ray needs Ray Data: pip install 'posttrain[ray]' (or set executor.kind=local)"
        ) from None
    return ray


def _ray_apply(row: dict[str, Any]) -> dict[str, Any]:
    fn, task = pickle.loads(row["payload"])
    return {"position": row["position"], "result": pickle.dumps(fn(task))}


def _run_ray(fn: Callable[[Any], Any], tasks: Sequence[Any], config: ExecutorConfig, desc: str,
             progress: bool) -> list[Any]:  # fmt: skip
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=config.ray_address, include_dashboard=False, log_to_driver=False,
                 num_cpus=None if config.ray_address else max(config.workers, 1))  # fmt: skip
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = progress
    items = [{"position": i, "payload": pickle.dumps((fn, task))} for i, task in enumerate(tasks)]
    dataset = ray.data.from_items(items, override_num_blocks=len(items))
    mapped = dataset.map(_ray_apply, concurrency=max(config.workers, 1))
    results: list[Any] = [None] * len(tasks)
    for row in mapped.iter_rows():
        results[row["position"]] = pickle.loads(row["result"])
    if any(result is None for result in results):
        raise RuntimeError(f"{desc}: Ray returned {sum(r is None for r in results)} shards without a result")
    return results
