"""A worker killed with SIGKILL: the job recovers from its checkpoint and ends
with exactly the loss of a failure-free run."""

from __future__ import annotations

import os
import signal

import pytest

from kuangchao.platform.procs import alive

from .conftest import wait_for

pytestmark = pytest.mark.integration

DONE = {"SUCCEEDED", "FAILED", "CANCELLED"}


def spec(stack, name):
    d = stack.job_doc(task={"name": name})
    d["training"].update(steps=300, seed=11, log_interval=50)
    d["checkpoint"]["interval_steps"] = 50
    return d


def test_sigkilled_worker_recovers_to_the_failure_free_loss(stack):
    clean = stack.client.submit(spec(stack, "ft-clean"))
    victim = stack.client.submit(spec(stack, "ft-killed"))
    wait_for(lambda: stack.client.job(victim["id"])["progress"]["step"] >= 60, 400,
             "the job to pass its first checkpoint")
    rank1 = next(p for p in stack.client.job(victim["id"])["placement"] if p["rank"] == 1)
    assert alive(rank1["pid"])
    os.kill(rank1["pid"], signal.SIGKILL)

    done = stack.wait_state(victim["id"], DONE, timeout=600)
    assert done["state"] == "SUCCEEDED", done["message"]
    assert done["restarts"] == 1 and len(done["restart_log"]) == 1
    entry = done["restart_log"][0]
    assert f"rank 1 on {rank1['node']} (pid {rank1['pid']}) died" in entry["cause"]
    assert entry["kind"] == "died" and entry["rank"] == 1 and entry["node"] == rank1["node"]
    # A process that exits is seen at once, not when its heartbeat expires.
    hb_timeout = victim["spec"]["fault_tolerance"]["heartbeat_timeout_s"]
    assert 0 <= entry["detected_after_s"] < hb_timeout
    for timing in ("teardown_s", "placement_s", "first_step_s"):
        assert entry[timing] >= 0, timing
    assert entry["path"] in ("in_place", "requeue")
    assert entry["first_step_at"] > entry["failed_at"]
    assert entry["resumed_step"] % 50 == 0 and entry["resumed_step"] >= 50
    failures = [e for e in stack.client.events(victim["id"])["events"] if e["type"] == "failure"]
    assert len(failures) == 1 and failures[0]["rank"] == 1
    states = [e["to"] for e in stack.client.events(victim["id"])["events"] if e["type"] == "state"]
    assert states[:4] == ["QUEUED", "PLACING", "RUNNING", "RECOVERING"]
    assert states[-1] == "SUCCEEDED" and states.count("RUNNING") == 2
    restored = [r["message"] for r in stack.client.logs(victim["id"])["logs"]
                if "restored checkpoint" in r["message"]]
    assert restored, "the job did not resume from a checkpoint"

    reference = stack.wait_state(clean["id"], DONE, timeout=600)
    assert reference["state"] == "SUCCEEDED" and reference["restarts"] == 0
    assert done["progress"]["loss"] == pytest.approx(reference["progress"]["loss"], rel=1e-6)
