"""Numeric-fault logic: which batch a step trains on, and when a norm is bad."""

from __future__ import annotations

import math

from kuangchao.workers.trainer.numerics import GradNormGuard, data_index, data_position


def test_no_skips_means_step_equals_batch():
    assert [data_index(s, []) for s in range(5)] == [0, 1, 2, 3, 4]


def test_a_skipped_batch_is_never_trained_on_and_none_repeats():
    skipped = [3, 7]
    used = [data_index(s, skipped) for s in range(10)]
    assert used == [0, 1, 2, 4, 5, 6, 8, 9, 10, 11]
    assert len(set(used)) == len(used)


def test_adjacent_skips_shift_by_two():
    assert [data_index(s, [2, 3]) for s in range(4)] == [0, 1, 4, 5]


def test_data_position_is_what_a_checkpoint_needs_to_resume():
    pos = data_position(5, [7, 3, 3])
    assert pos == {"step": 5, "next_batch": 6, "skipped_batches": [3, 7]}


def test_guard_flags_nan_and_inf_at_once():
    g = GradNormGuard(factor=10, window=5)
    assert "NaN" in g.check(float("nan"))
    assert g.check(math.inf) is not None
    assert g.state() == []


def test_guard_waits_for_a_full_window_before_judging_spikes():
    g = GradNormGuard(factor=10, window=3)
    assert g.check(1.0) is None
    assert g.check(100.0) is None  # window not full yet: early noise is tolerated
    assert g.check(1.0) is None
    assert g.check(1.5) is None  # median of [1, 100, 1] is 1; 1.5 < 10
    spike = g.check(50.0)  # median of [100, 1, 1.5] is 1.5
    assert spike is not None and "running median" in spike
    assert g.state() == [100.0, 1.0, 1.5]  # the bad norm is not remembered


def test_guard_state_round_trips():
    g = GradNormGuard(factor=4, window=3)
    for n in (1.0, 2.0, 3.0):
        g.check(n)
    h = GradNormGuard(factor=4, window=3)
    h.load_state(g.state())
    assert h.check(100.0) is not None and g.check(100.0) is not None
