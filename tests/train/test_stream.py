from __future__ import annotations

import numpy as np

from posttrain.train.schedule import lr_multiplier
from posttrain.train.stream import Difficulty, build_stream, competence, difficulty_order, step_slice


def items(n=30):
    return [Difficulty(tier=1 + i % 3, difficulty=None) for i in range(n)]


def test_tiered_epoch_goes_easy_to_hard():
    data = items()
    stream = build_stream(data, "tiered", seed=1, epochs=1.0, examples_per_step=3, max_steps=None)
    tiers = [data[i].tier for i in stream]
    assert tiers == sorted(tiers)
    assert sorted(stream.tolist()) == list(range(len(data)))  # every example exactly once


def test_competence_pool_grows_and_reaches_everything():
    data = items(60)
    order = difficulty_order(data)
    stream = build_stream(data, "competence", seed=0, epochs=None, examples_per_step=6, max_steps=40,
                          competence_start=0.2, competence_steps=20)
    rank = {int(idx): pos for pos, idx in enumerate(order)}
    per_step = stream.reshape(40, 6)
    for step, draws in enumerate(per_step):
        limit = int(np.ceil(competence(step, 20, 0.2) * 60))
        assert max(rank[int(i)] for i in draws) < limit
    early = np.mean([data[i].tier for i in per_step[:5].ravel()])
    late = np.mean([data[i].tier for i in per_step[-5:].ravel()])
    assert early < late
    assert competence(0, 20, 0.2) == 0.2 and competence(20, 20, 0.2) == 1.0


def test_none_is_a_fresh_permutation_per_epoch_and_seeded():
    data = items(10)
    a = build_stream(data, "none", seed=3, epochs=2.0, examples_per_step=2, max_steps=None)
    b = build_stream(data, "none", seed=3, epochs=2.0, examples_per_step=2, max_steps=None)
    assert (a == b).all() and len(a) == 20
    assert sorted(a[:10].tolist()) == list(range(10)) and (a[:10] != a[10:]).any()


def test_step_slices_partition_the_global_batch():
    batch, accum, world = 2, 3, 2
    seen = []
    for micro in range(accum):
        for rank in range(world):
            s = step_slice(5, micro, rank, batch, accum, world)
            seen.extend(range(s.start, s.stop))
    assert sorted(seen) == list(range(5 * 12, 6 * 12))


def test_lr_schedules():
    assert lr_multiplier(0, 100, "cosine", 10, 0.0) == 0.1
    assert lr_multiplier(10, 100, "cosine", 10, 0.0) == 1.0
    assert abs(lr_multiplier(100, 100, "cosine", 10, 0.1) - 0.1) < 1e-12
    assert abs(lr_multiplier(55, 100, "linear", 10, 0.0) - 0.5) < 1e-12
    assert lr_multiplier(99, 100, "constant", 0, 0.0) == 1.0
