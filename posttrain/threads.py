"""How torch's CPU threads behave, decided once per process before torch loads.

torch's CPU kernels run on an OpenMP pool (libgomp in the Linux wheels), one thread per core. Between
parallel regions its threads spin-wait, and torch's gaps between regions are shorter than libgomp's
spin, so an idle thread never sleeps: it keeps its core busy. That is fastest on a machine nobody else
uses, and a disaster on a shared one: beside one other job (another training run, a test suite, another
user) every core is fought over by spinning threads, and both jobs slow down by 5× or more (the
quickstart took 24 minutes instead of 4). ``configure_threads`` therefore sets:

* the thread count: ``requested`` when the caller has an explicit setting (a recipe's ``threads:``
  key), else ``OMP_NUM_THREADS`` when it is set (by a user, torchrun, a test runner), else every core
  this process may run on;
* ``OMP_WAIT_POLICY=PASSIVE`` unless it is set: a waiting thread sleeps at once and hands its core to
  whoever has work.

Measured (``benchmarks/threads.py``, figures in ``benchmarks/README.md``): with PASSIVE, a second copy
beside the first costs what sharing the cores fairly costs (about 2× on 2 cores), not the 5–34× of
spinning; a load-average rule (one thread when the cores look busy) bought nothing on top of PASSIVE
and reacts a minute late; short spins (``GOMP_SPINCOUNT``) were worse than PASSIVE under contention.
The price: on an otherwise idle machine the tiny demo model trains about 1.4× slower than with
spinning threads (still faster than one thread; 1.08× on a 4× wider model). On a machine of your own,
``OMP_WAIT_POLICY=ACTIVE`` brings spinning back.

OpenMP reads these variables once, when torch loads it: call this before the first ``import torch``
(the CLI does, before every command). If torch is already imported, only ``torch.set_num_threads`` can
still change, and it is called.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str  # requested | OMP_NUM_THREADS | all cores


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity mask, which containers and taskset narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def _env_threads() -> int | None:
    value = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def choose_threads(requested: int | None = None) -> ThreadChoice:
    """The thread count: ``requested`` > ``OMP_NUM_THREADS`` > every usable core."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"threads must be >= 1 (got {requested})")
        return ThreadChoice(requested, "requested")
    from_env = _env_threads()
    if from_env is not None:
        return ThreadChoice(from_env, "OMP_NUM_THREADS")
    return ThreadChoice(usable_cores(), "all cores")


def configure_threads(requested: int | None = None) -> ThreadChoice:
    """Choose the thread count and apply it with PASSIVE waiting; see the module docstring. Idempotent."""
    choice = choose_threads(requested)
    os.environ["OMP_NUM_THREADS"] = str(choice.threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(choice.threads)
    return choice


# One decode step of a small model (2 · parameters · rows FLOPs) is too little work to split over sleeping
# threads: under OMP_WAIT_POLICY=PASSIVE every op pays a thread wake-up. Measured on 2 cores: a
# 4.3M-parameter model decoding 32 rows (0.27 GFLOP per step) takes 0.25 s instead of 0.42 s with its
# decode steps on one thread (benchmarks/README.md, grpo_throughput); a 43M one (2.7 GFLOP per step)
# is 1.3x slower on one thread than on two, so it keeps both.
SMALL_STEP_FLOPS = 1e9


@contextmanager
def one_thread_for_small_steps(flops_per_step: float) -> Iterator[int]:
    """Inside, torch uses one thread when each step is below ``SMALL_STEP_FLOPS`` and threads sleep while they
    wait (PASSIVE, posttrain's default); otherwise nothing changes. Yields the thread count in use."""
    import torch

    current = torch.get_num_threads()
    passive = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
    if current == 1 or not passive or flops_per_step >= SMALL_STEP_FLOPS:
        yield current
        return
    torch.set_num_threads(1)
    try:
        yield 1
    finally:
        torch.set_num_threads(current)

