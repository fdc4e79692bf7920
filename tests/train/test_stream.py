from __future__ import annotations

import numpy as np
import pytest

from posttrain.train.schedule import lr_multiplier
from posttrain.train.source import BatchGeometry, BatchSizeError
from posttrain.train.stream import Difficulty, build_stream, check_curriculum, competence, difficulty_order


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
    geometry = BatchGeometry.derive(global_batch=12, batch_size=2, world=2)
    assert (geometry.per_rank, geometry.micro_batch, geometry.grad_accum) == (6, 2, 3)
    seen = []
    for micro in range(geometry.grad_accum):
        for rank in range(geometry.world):
            s = geometry.micro_slice(5, micro, rank)
            seen.extend(range(s.start, s.stop))
    assert sorted(seen) == list(range(5 * 12, 6 * 12))


def test_a_step_holds_the_same_units_on_any_number_of_ranks():
    for world, batch_size in ((1, 3), (2, 2), (3, 4), (4, 1), (6, 2)):
        geometry = BatchGeometry.derive(global_batch=12, batch_size=batch_size, world=world)
        units = sorted(
            i for micro in range(geometry.grad_accum) for rank in range(world)
            for i in range(*geometry.micro_slice(3, micro, rank).indices(10**6))
        )
        assert units == list(range(36, 48)), world


def test_a_global_batch_that_does_not_split_is_refused_with_the_fix():
    with pytest.raises(BatchSizeError, match="multiple of 4"):
        BatchGeometry.derive(global_batch=10, batch_size=2, world=4)
    with pytest.raises(BatchSizeError, match=r"train.batch_size to one of \[1, 2, 3, 6\]"):
        BatchGeometry.derive(global_batch=12, batch_size=4, world=2)


def test_lr_schedules():
    assert lr_multiplier(0, 100, "cosine", 10, 0.0) == 0.1
    assert lr_multiplier(10, 100, "cosine", 10, 0.0) == 1.0
    assert abs(lr_multiplier(100, 100, "cosine", 10, 0.1) - 0.1) < 1e-12
    assert abs(lr_multiplier(55, 100, "linear", 10, 0.0) - 0.5) < 1e-12
    assert lr_multiplier(99, 100, "constant", 0, 0.0) == 1.0


def test_tiered_on_untiered_data_is_the_seeded_shuffle_of_none_and_strict_refuses_it():
    untiered = [Difficulty(tier=None, difficulty=None) for _ in range(12)]
    for shuffle in (True, False):
        tiered = build_stream(untiered, "tiered", seed=3, epochs=2.0, examples_per_step=4, max_steps=None,
                              shuffle=shuffle)
        plain = build_stream(untiered, "none", seed=3, epochs=2.0, examples_per_step=4, max_steps=None,
                             shuffle=shuffle)
        assert tiered.tolist() == plain.tolist()  # the fallback is exactly data.curriculum=none
    warning = check_curriculum("tiered", untiered, "train.jsonl")
    assert warning is not None and "none of the 12 records has `tier`" in warning and "seeded shuffle" in warning
    assert "data.curriculum=tiered_strict" in warning
    with pytest.raises(ValueError, match="data.curriculum=tiered_strict but none of the 12 records has `tier`"):
        check_curriculum("tiered_strict", untiered, "train.jsonl")
    with pytest.raises(ValueError, match="data.curriculum=competence but none of the 12 records"):
        check_curriculum("competence", untiered, "train.jsonl")


def test_tiered_strict_orders_tagged_data_as_tiered_does():
    data = items()
    assert check_curriculum("tiered_strict", data, "train.jsonl") is None
    strict = build_stream(data, "tiered_strict", seed=1, epochs=1.0, examples_per_step=3, max_steps=None)
    assert strict.tolist() == build_stream(data, "tiered", seed=1, epochs=1.0, examples_per_step=3,
                                           max_steps=None).tolist()
