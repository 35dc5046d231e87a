"""The job store against a real Redis: compare-and-set and the active-job index."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kuangchao.platform.jobs.state import JobRecord, JobState

pytestmark = pytest.mark.integration


def job(i: int) -> JobRecord:
    return JobRecord(id=f"j{i:03d}", name="j", spec={}, created_at=float(i))


def test_active_index_keeps_old_waiting_jobs_and_drops_finished_ones(store):
    for i in range(30):
        store.create(job(i))
    store.transition("j005", JobState.CANCELLED, "done")
    assert "j000" not in {j.id for j in store.list(limit=10)}  # older than the newest 10
    active = [j.id for j in store.list_active()]
    assert active[0] == "j000" and "j005" not in active and len(active) == 29


def test_update_loses_no_write_when_two_writers_race(store):
    store.create(job(1))
    seen = []

    def bump(j):
        if not seen:  # a second writer slips in between this read and its write
            seen.append(1)
            store.update(j.id, lambda k: (replace(k, restarts=k.restarts + 1), None))
        return replace(j, preemptions=j.preemptions + 1), None

    out = store.update("j001", bump)
    assert out.restarts == 1 and out.preemptions == 1 and out.version == 3
