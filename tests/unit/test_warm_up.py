"""A warm spare's warm-up (workers/runtime/warm_up.py): it must leave the process as a
rank needs to find it, its global random state untouched, CUDA not started (the GPUs are
known only when the spare adopts a rank) and its own priority where it was."""

import gc
import os
import sys
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


def _priority():
    """This thread's scheduling policy and niceness."""
    tid = threading.get_native_id()
    return os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, tid)


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own priority is Linux's")
def test_the_warm_up_imports_and_exercises_at_idle_priority_and_raises_its_errors(monkeypatch,
                                                                                 tmp_path):
    seen = []

    def exercise():
        seen.append((threading.current_thread().name, "kc_warm_probe" in sys.modules,
                     os.sched_getscheduler(0)))

    monkeypatch.setattr(warm_up, "exercise", exercise)
    monkeypatch.setattr(warm_up, "settle_heap", lambda: seen.append("settled"))
    monkeypatch.syspath_prepend(str(_probe_module(tmp_path)))
    mine = _priority()
    assert warm_up.warm(("kc_warm_probe",), niceness=3) == "idle"
    assert seen == [("kc-spare-warm-up", True, os.SCHED_IDLE), "settled"]
    # The import itself ran in the idle thread, not in the caller's.
    assert sys.modules["kc_warm_probe"].POLICY == os.SCHED_IDLE
    assert _priority() == mine  # the thread's only: the rank the spare becomes keeps its own
    with pytest.raises(ModuleNotFoundError, match="kc_no_such_trainer"):
        warm_up.warm(("kc_no_such_trainer",), niceness=3)
    del sys.modules["kc_warm_probe"]


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own priority is Linux's")
def test_a_warm_up_still_idle_after_its_idle_time_goes_on_at_the_lowest_niceness(monkeypatch):
    went_on = threading.Event()
    seen = []

    def exercise():
        seen.append(_priority())  # at SCHED_IDLE
        assert went_on.wait(10), "the warm-up was not moved out of SCHED_IDLE"
        seen.append(_priority())

    def out_of_idle(tid, niceness):
        got = real(tid, niceness)
        went_on.set()
        return got

    real = warm_up.out_of_idle
    monkeypatch.setattr(warm_up, "out_of_idle", out_of_idle)
    monkeypatch.setattr(warm_up, "exercise", exercise)
    monkeypatch.setattr(warm_up, "settle_heap", lambda: None)
    mine = _priority()
    assert warm_up.warm(("json",), niceness=3, idle_for_s=0.2) == "idle, then nice+3"
    assert seen[0][0] == os.SCHED_IDLE
    assert seen[1] == (os.SCHED_OTHER, min(19, mine[1] + 3))
    assert _priority() == mine


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own priority is Linux's")
def test_without_sched_idle_the_warm_up_drops_its_niceness(monkeypatch):
    def refused(*_a):
        raise PermissionError("no SCHED_IDLE here")

    monkeypatch.setattr(os, "sched_setscheduler", refused)
    seen = []
    monkeypatch.setattr(warm_up, "exercise", lambda: seen.append(_priority()))
    monkeypatch.setattr(warm_up, "settle_heap", lambda: None)
    mine = _priority()
    assert warm_up.warm(("json",), niceness=3) == "nice+3"
    assert seen == [(mine[0], min(19, mine[1] + 3))]
    assert _priority() == mine


def test_the_spare_imports_the_worker_and_the_built_in_trainer():
    from kuangchao.workers.runtime.worker import BUILTIN_TRAINER

    assert warm_up.SPARE_MODULES[0] == "kuangchao.workers.runtime.worker"
    assert BUILTIN_TRAINER.partition(":")[0] in warm_up.SPARE_MODULES


def _probe_module(folder):
    """A module that records, as it is imported, the policy of the thread importing it."""
    (folder / "kc_warm_probe.py").write_text("import os\nPOLICY = os.sched_getscheduler(0)\n")
    return folder


def test_settle_heap_takes_what_lives_out_of_the_collector_s_sight():
    try:
        warm_up.settle_heap()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # this test process's other tests expect a plain collector
