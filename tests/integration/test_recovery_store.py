"""Failure bookkeeping against a real Redis: restarts, the restart log, node
quarantine, and the scheduler's check for jobs whose controller is gone."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kuangchao.platform.cluster.quarantine import QuarantinePolicy, active
from kuangchao.platform.execution.recovery import Failure, record_failure, requeue_for_recovery
from kuangchao.platform.jobs.state import JobRecord, JobState
from kuangchao.platform.scheduling.orphans import ORPHAN_AFTER_S, OrphanCheck
from kuangchao.platform.settings import Settings

pytestmark = pytest.mark.integration

POLICY = QuarantinePolicy(failures=2, window_s=60, duration_s=300, lost_node_s=30)


def running(store, job_id="r1", max_restarts=2, **fields):
    job = JobRecord(id=job_id, name="r", spec={"fault_tolerance": {"max_restarts": max_restarts}},
                    **fields)
    store.create(job)
    store.update(job_id, lambda j: (replace(j, state=JobState.RUNNING), None))
    return store.get(job_id)


def test_a_failure_is_a_restart_with_its_record_and_event(store):
    running(store)
    f = Failure("died", "rank 1 on n1 (pid 7) died", rank=1, node="n1", pid=7,
                detected_after_s=0.2, failed_at=1000.0)
    assert record_failure(store, "r1", f, max_restarts=2, policy=POLICY)
    job = store.get("r1")
    assert job.state is JobState.RECOVERING and job.restarts == 1
    entry = job.restart_log[0]
    assert entry["restart"] == 1 and entry["kind"] == "died" and entry["rank"] == 1
    assert entry["cause"] == "rank 1 on n1 (pid 7) died" and entry["detected_after_s"] == 0.2
    failure = [e for e in store.events("r1") if e["type"] == "failure"]
    assert failure and failure[0]["node"] == "n1"
    # A second path seeing the same failure does not count it twice.
    assert not record_failure(store, "r1", f, max_restarts=2, policy=POLICY)
    assert store.get("r1").restarts == 1


def test_timings_fill_in_and_the_job_goes_back_to_the_queue(store):
    running(store)
    record_failure(store, "r1", Failure("died", "x", rank=0), 2, POLICY)
    requeue_for_recovery(store, "r1", teardown_s=0.1234)
    store.annotate_restart("r1", {"placement_s": 2.5, "teardown_s": 99})
    job = store.get("r1")
    assert job.state is JobState.QUEUED
    entry = job.restart_log[-1]
    assert entry["path"] == "requeue" and entry["teardown_s"] == 0.123  # the first value stays
    assert entry["placement_s"] == 2.5


def test_past_max_restarts_the_job_fails_with_the_cause(store):
    running(store, max_restarts=1, restarts=1)
    assert not record_failure(store, "r1", Failure("hung", "rank 0 hung"), 1, POLICY)
    job = store.get("r1")
    assert job.state is JobState.FAILED
    assert job.message.startswith("rank 0 hung; gave up after 1 restart(s)")


def test_a_node_failing_twice_in_the_window_is_quarantined(store):
    running(store, "a")
    running(store, "b")
    record_failure(store, "a", Failure("died", "one", node="n1", failed_at=1000.0), 3, POLICY)
    assert "n1" not in store.quarantine()
    record_failure(store, "b", Failure("expired", "two", node="n1", failed_at=1030.0), 3, POLICY)
    entry = store.quarantine()["n1"]
    assert entry["until"] == 1330.0 and entry["failures"] == 2 and "two" in entry["reason"]
    assert any(e["type"] == "quarantine" for e in store.events("b"))
    assert "n1" in active(store.quarantine(), 1329.0) and "n1" not in active(store.quarantine(), 1331.0)
    assert store.release_node("n1") and not store.release_node("n1")


def test_numeric_faults_do_not_count_against_the_node(store):
    running(store, "a", max_restarts=5)
    for t in (1.0, 2.0, 3.0):
        store.update("a", lambda j: (replace(j, state=JobState.RUNNING), None))
        record_failure(store, "a", Failure("numeric", "nan", node="n1", failed_at=t), 5, POLICY)
    assert store.quarantine() == {}


def test_a_lost_node_is_held_back_at_once(store):
    running(store)
    record_failure(store, "r1", Failure("node_lost", "raylet gone", node="n2", failed_at=50.0),
                   3, POLICY)
    assert store.quarantine()["n2"]["until"] == 80.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_job_whose_controller_is_gone_is_recovered_after_a_while(store):
    running(store, "orphan")
    running(store, "fine")
    store.claim_controller("orphan", "kc-job-orphan-1/123")
    store.claim_controller("fine", "kc-job-fine-1/456")
    clock = Clock()
    check = OrphanCheck(store, Settings(None, store.p, None, ""), lambda name: "fine" in name,
                        clock=clock)
    assert check.check() == []  # missing, but not for long enough
    clock.now = ORPHAN_AFTER_S + 1
    assert check.check() == ["orphan"]
    job = store.get("orphan")
    assert job.state is JobState.QUEUED and job.restart_log[0]["kind"] == "controller"
    assert store.get("fine").state is JobState.RUNNING


def test_a_controller_that_comes_back_is_not_an_orphan(store):
    running(store, "blip")
    store.claim_controller("blip", "kc-job-blip-1/1")
    clock, alive = Clock(), {"ok": False}
    check = OrphanCheck(store, Settings(None, store.p, None, ""), lambda n: alive["ok"], clock=clock)
    check.check()
    alive["ok"] = True
    clock.now = ORPHAN_AFTER_S + 1
    assert check.check() == []
    alive["ok"] = False
    assert check.check() == []  # the clock restarts from this sighting
    assert store.get("blip").state is JobState.RUNNING
