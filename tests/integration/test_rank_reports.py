"""The ranks' reports against a real Redis: posted by a rank, applied by the
controller's side (platform/execution/reports.py), which alone writes the job."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kuangchao.platform.execution.reports import apply_reports
from kuangchao.platform.jobs.state import JobRecord, JobState

pytestmark = pytest.mark.integration


def running(store, job_id="rr1", **fields) -> JobRecord:
    store.create(JobRecord(id=job_id, name="r", spec={}, **fields))
    store.update(job_id, lambda j: (replace(j, state=JobState.RUNNING), None))
    return store.get(job_id)


def test_a_numeric_fault_report_is_a_restart_and_its_answer_says_roll_back(store):
    running(store)
    store.post_report("rr1", {"kind": "numeric_fault", "id": "f1", "message": "loss is nan at step 7"})
    assert store.report_answer("rr1", "f1") is None
    assert apply_reports(store, "rr1", max_restarts=2) == 1
    job = store.get("rr1")
    assert job.state is JobState.RECOVERING and job.restarts == 1
    assert job.restart_log[-1]["kind"] == "numeric"
    assert store.report_answer("rr1", "f1") == {"roll_back": True}
    assert apply_reports(store, "rr1", max_restarts=2) == 0, "a report is applied once"

    store.post_report("rr1", {"kind": "rolled_back", "reason": "rolled back to step 5; skipping batches [7]",
                              "restart": {"path": "rollback", "restore_s": 0.4, "resumed_step": 5}})
    apply_reports(store, "rr1", max_restarts=2)
    job = store.get("rr1")
    assert job.state is JobState.RUNNING and job.restart_log[-1]["path"] == "rollback"
    assert store.events("rr1")[-1]["message"] == "rolled back to step 5; skipping batches [7]"


def test_a_numeric_fault_past_max_restarts_fails_the_job_and_answers_no(store):
    running(store, restarts=2)
    store.post_report("rr1", {"kind": "numeric_fault", "id": "f2", "message": "grad norm spike"})
    apply_reports(store, "rr1", max_restarts=2)
    job = store.get("rr1")
    assert job.state is JobState.FAILED and "fault_tolerance.max_restarts" in job.message
    assert store.report_answer("rr1", "f2") == {"roll_back": False}


def test_the_first_step_at_a_new_size_closes_the_resize_with_its_event(store):
    running(store, resize_log=({"from": 1, "to": 2, "from_world_size": 2, "to_world_size": 4,
                                "cause": "grow", "requested_at": 100.0},))
    store.post_report("rr1", {"kind": "first_step", "at": 103.5, "world_size": 4})
    apply_reports(store, "rr1", max_restarts=2)
    entry = store.get("rr1").resize_log[-1]
    assert entry["first_step_at"] == 103.5 and entry["resize_s"] == 3.5
    event = store.events("rr1")[-1]
    assert event["type"] == "resize" and event["resize_s"] == 3.5 and event["to_world_size"] == 4


def test_unknown_or_malformed_reports_are_dropped_and_the_rest_applied(store):
    running(store)
    store.post_report("rr1", {"kind": "set_state", "state": "SUCCEEDED"})
    store.post_report("rr1", {"kind": "rolled_back"})  # no reason, no restart
    store.post_report("rr1", {"kind": "numeric_fault", "id": "f3", "message": "nan"})
    assert apply_reports(store, "rr1", max_restarts=3) == 3
    job = store.get("rr1")
    assert job.state is JobState.RECOVERING and job.restarts == 1
