"""A warm spare's warm-up (workers/runtime/warm_up.py): it must leave the process as a
rank needs to find it, its global random state untouched, CUDA not started (the GPUs are
known only when the spare adopts a rank) and its own priority where it was."""

import gc
import os
import threading

import pytest
import torch

from kuangchao.workers.runtime import warm_up


def test_the_warm_up_step_keeps_the_random_state_and_never_starts_cuda(monkeypatch):
    def no_cuda(*_a, **_k):
        raise AssertionError("the warm-up started CUDA before the spare knew its GPUs")

    monkeypatch.setattr(torch.cuda, "_lazy_init", no_cuda)
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    expected = torch.rand(3)
    torch.random.set_rng_state(before)
    warm_up.exercise()
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(torch.rand(3), expected)


def test_the_warm_up_runs_below_the_caller_s_priority_and_raises_its_errors(monkeypatch):
    seen = []

    def exercise():
        tid = threading.get_native_id()
        seen.append((threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, tid)))

    monkeypatch.setattr(warm_up, "exercise", exercise)
    monkeypatch.setattr(warm_up, "settle_heap", lambda: seen.append("settled"))
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    warm_up.warm("json", niceness=3)
    assert seen == [("kc-spare-warm-up", min(19, mine + 3)), "settled"]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the thread's only
    with pytest.raises(ModuleNotFoundError, match="kc_no_such_trainer"):
        warm_up.warm("kc_no_such_trainer", niceness=3)


def test_settle_heap_takes_what_lives_out_of_the_collector_s_sight():
    try:
        warm_up.settle_heap()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # this test process's other tests expect a plain collector
