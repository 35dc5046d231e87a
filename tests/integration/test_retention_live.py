"""Finished jobs leave Redis after their retention, on the real Redis and in the running
control plane (platform/scheduling/retention.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kuangchao.platform.errors import JobNotFound
from kuangchao.platform.jobs import keys
from kuangchao.platform.jobs.state import JobRecord, fail
from kuangchao.platform.scheduling.retention import DAY_S, RetentionSweep
from kuangchao.platform.security.audit import AuditLog

pytestmark = pytest.mark.integration


def test_a_sweep_deletes_an_old_finished_job_and_its_keys_and_audits_it_to_stream_and_file(
        store, tmp_path):
    now = 1_800_000_000.0
    for i, finished in enumerate((now - 31 * DAY_S, now - 29 * DAY_S)):
        job_id = f"ret{i}"
        store.create(JobRecord(id=job_id, name="r", spec={}, created_at=now - 40 * DAY_S + i))
        store.update(job_id, lambda j: fail(j, "over"))
        store.update(job_id, lambda j, at=finished: (replace(j, finished_at=at), None))
        store.add_logs(job_id, [{"rank": 0, "message": "a line"}])
        store.set_progress(job_id, {"step": 9})
    trail = AuditLog(store, tmp_path / "audit.jsonl")
    sweep = RetentionSweep(store, 30, trail, clock=lambda: now)
    assert sweep.sweep() == ["ret0"]
    with pytest.raises(JobNotFound):
        store.get("ret0")
    # Nothing of it is left under the prefix; the other job keeps all of its keys.
    left = sorted(store.r.scan_iter(match=store.p + "*ret0*", count=1000))
    assert left == [], left
    assert store.get("ret1").state.value == "FAILED" and store.logs("ret1")
    assert store.r.zscore(keys.jobs(store.p), "ret1") is not None
    streamed = [json.loads(line) for line in store.audit_lines()]
    filed = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    for records in (streamed, filed):
        (rec,) = [r for r in records if r["action"] == "job.purge"]
        assert rec["resource"] == "job/ret0" and rec["principal"] == "kc-scheduler"


def test_the_control_planes_scheduler_sweeps_with_the_stacks_retention(stack, ray_driver):
    from kuangchao.platform.runtime.actors import find_scheduler

    scheduler = find_scheduler()
    assert scheduler is not None
    info = ray_driver.get(scheduler.info.remote(), timeout=60)
    assert info["retention_days"] == 30.0  # the default: the stack sets no KC_JOB_RETENTION_DAYS
    assert info["jobs_purged"] == 0  # a new prefix holds no job old enough
