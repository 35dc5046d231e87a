"""The stacks a failure's record carries (platform/execution/watch.py `collect_stacks`):
every rank is asked through its heartbeat thread; ranks whose beats expired are not
waited for, since their heartbeat thread is what stopped."""

from __future__ import annotations

import threading
import time

from kuangchao.platform.execution import watch as watch_mod
from kuangchao.platform.execution.watch import RankWatch
from kuangchao.platform.jobs.memory import MemoryStore


def answering(store: MemoryStore, job_id: str, rank: int) -> threading.Thread:
    """Rank `rank`'s heartbeat thread: it answers once it sees the request."""
    def run() -> None:
        deadline = time.monotonic() + 30
        while not store.stack_requested(job_id, rank) and time.monotonic() < deadline:
            time.sleep(0.01)
        store.answer_stacks(job_id, rank, f"stacks of {rank}: train_step")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_an_expired_rank_is_not_waited_for_once_the_others_answered(monkeypatch):
    monkeypatch.setattr(watch_mod, "STACK_WAIT_S", 60.0)  # waiting it out would be plain
    store = MemoryStore(prefix=f"kc-test-{time.monotonic_ns()}:")
    w = RankWatch(store, "j1", [0, 1], heartbeat_timeout_s=5, hang_timeout_s=60, interval_s=0.5)
    helper = answering(store, "j1", 0)
    t0 = time.monotonic()
    got = w.collect_stacks([1], silent=[1])
    assert time.monotonic() - t0 < 30
    helper.join()
    assert got[0] == "stacks of 0: train_step"
    assert "no answer from the rank's heartbeat thread" in got[1]  # the view from outside


def test_a_suspect_whose_heartbeat_runs_is_waited_for(monkeypatch):
    # A stalled rank (beats go on, steps do not): its heartbeat thread answers with the
    # stacks of the hang, so the wait is for it too.
    monkeypatch.setattr(watch_mod, "STACK_WAIT_S", 60.0)
    store = MemoryStore(prefix=f"kc-test-{time.monotonic_ns()}:")
    w = RankWatch(store, "j1", [0, 1], heartbeat_timeout_s=5, hang_timeout_s=60, interval_s=0.5)
    late = threading.Timer(0.5, lambda: answering(store, "j1", 1))
    late.start()
    helper = answering(store, "j1", 0)
    got = w.collect_stacks([1])
    helper.join()
    late.join()
    assert got == {0: "stacks of 0: train_step", 1: "stacks of 1: train_step"}
