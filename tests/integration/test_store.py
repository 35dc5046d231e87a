"""The job store against a real Redis: compare-and-set and the active-job index."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kuangchao.platform.jobs import keys
from kuangchao.platform.jobs.state import JobRecord, cancel

pytestmark = pytest.mark.integration


def job(i: int) -> JobRecord:
    return JobRecord(id=f"j{i:03d}", name="j", spec={}, created_at=float(i))


def test_active_index_keeps_old_waiting_jobs_and_drops_finished_ones(store):
    for i in range(30):
        store.create(job(i))
    store.update("j005", lambda j: cancel(j, "done"))
    assert "j000" not in {j.id for j in store.list(limit=10)}  # older than the newest 10
    active = [j.id for j in store.list_active()]
    assert active[0] == "j000" and "j005" not in active and len(active) == 29


def raced_once(store, change, rival):
    """`change`, wrapped so that on its first run `rival` is committed between its
    read and its write (its compare-and-set then fails once and it runs again)."""
    raced = []

    def run(j):
        if not raced:
            raced.append(1)
            store.update(j.id, rival)
        return change(j)
    return run


def test_update_loses_no_write_when_two_writers_race(store):
    store.create(job(1))
    bump = raced_once(store, lambda j: (replace(j, preemptions=j.preemptions + 1), None),
                      lambda k: (replace(k, restarts=k.restarts + 1), None))
    out = store.update("j001", bump)
    assert out.restarts == 1 and out.preemptions == 1 and out.version == 3


def test_a_finishing_commit_records_its_event_active_set_and_counter_at_once(store):
    from kuangchao.platform.jobs.state import fail
    from kuangchao.platform.observability import metrics

    store.create(job(7))
    store.r.set(keys.targets(store.p, "j007"), "[]")
    counter = keys.cluster_metrics(store.p)
    (field,) = metrics.increments(metrics.JOBS_FINISHED, 1.0, {"state": "FAILED", "queue": "default"})
    out = store.update("j007", lambda j: fail(j, "boom"))
    assert out.state.value == "FAILED" and out.version == 2
    assert store.events("j007")[-1]["to"] == "FAILED" and store.events("j007")[-1]["message"] == "boom"
    assert "j007" not in {j.id for j in store.list_active()}
    assert not store.r.exists(keys.targets(store.p, "j007"))
    assert float(store.r.hget(counter, field)) == 1.0
    # Applying the operation again changes nothing: no second event, no second count.
    assert store.update("j007", lambda j: fail(j, "again")) is None
    assert len(store.events("j007")) == 2 and float(store.r.hget(counter, field)) == 1.0


def test_a_commit_that_loses_the_race_appends_no_event(store):
    from kuangchao.platform.jobs.state import admit

    store.create(job(8))
    admit_raced = raced_once(store, lambda j: admit(j, "admitted"),
                             lambda k: (replace(k, priority=k.priority + 1), None))
    out = store.update("j008", admit_raced)
    assert out.state.value == "PLACING" and out.priority == 51
    assert [e["to"] for e in store.events("j008") if e["type"] == "state"] == ["QUEUED", "PLACING"]
