"""Survivors keep their work: a rank of a fixed-size job (no elastic range) SIGKILLed
between two checkpoints, on the shared stack.

The built-in trainer with plain data parallelism resizes live, so the failed
replica is refilled at the same size (by the warm spare on its node) through a
live generation change: the surviving rank keeps its process and its state,
goes on from its own step, and restores nothing. No step is redone, so the
job's goodput has no `redone` time, its loss curve never goes back, and its
final loss is that of a run never killed. The restart entry says `path: live`
and how long the survivors stalled (`survivor_stall_s`).
"""

from __future__ import annotations

import os
import signal

import pytest

from kuangchao.platform.runtime.procs import alive

from .conftest import wait_for
from .test_fault_tolerance import adds_up_to_wall_clock, stop_past_a_checkpoint

pytestmark = pytest.mark.integration

DONE = {"SUCCEEDED", "FAILED", "CANCELLED"}
EVERY = 10  # checkpoint interval: the kill lands between two checkpoints


def spec(stack, name: str, **fault_tolerance) -> dict:
    """Two data-parallel ranks, one size (min == max replicas), the built-in trainer."""
    d = stack.job_doc(task={"name": name})
    d["training"].update(steps=300, seed=13, log_interval=5)
    d["checkpoint"]["interval_steps"] = EVERY
    if fault_tolerance:
        d["fault_tolerance"] = fault_tolerance
    return d


def test_a_killed_ranks_survivor_keeps_its_work_and_ends_at_the_failure_free_loss(stack):
    client = stack.client
    clean = client.submit(spec(stack, "kept-clean"))
    victim = client.submit(spec(stack, "kept-killed", spare_workers=True))
    wait_for(lambda: (j := client.get(victim["id"]))["checkpoints"]
             and j["progress"]["step"] > EVERY, 400, "the job to pass its first checkpoint")
    placed = {p["rank"]: p for p in client.get(victim["id"])["placement"]}
    assert alive(placed[1]["pid"]) and alive(placed[0]["pid"])
    # Stopped (its peer waits in the next collective) at a step no checkpoint is of,
    # then killed: a restore would redo the steps since the last checkpoint.
    stopped = stop_past_a_checkpoint(stack, victim["id"], placed[1]["pid"], every=EVERY)
    os.kill(placed[1]["pid"], signal.SIGKILL)

    done = stack.wait_state(victim["id"], DONE, timeout=600)
    assert done["state"] == "SUCCEEDED", done["message"]
    assert done["restarts"] == 1 and len(done["restart_log"]) == 1
    entry = done["restart_log"][0]
    print(f"killed at step {stopped}; restart entry {entry}")
    assert entry["kind"] == "died" and entry["rank"] == 1
    # Refilled live by the warm spare on its node; the survivor went on from its own step.
    assert entry["path"] == "live" and entry["spare"] is True, entry
    # Its own step: the one read at the stop, or one more where the stopped rank had sent
    # its part of that step's all-reduce first (stop_past_a_checkpoint). Neither is a
    # checkpoint's step.
    resumed = entry["resumed_step"]
    assert resumed in (stopped, stopped + 1) and resumed % EVERY, entry
    stall = entry["survivor_stall_s"]
    assert isinstance(stall, float) and 0 < stall < 60, entry
    assert entry["first_step_at"] - entry["failed_at"] == pytest.approx(stall, abs=0.01)
    # The survivor's process is the one it was; the dead rank's slot holds a new one.
    after = {p["rank"]: p for p in done["placement"]}
    assert after[0]["pid"] == placed[0]["pid"] and after[0]["node"] == placed[0]["node"]
    assert after[1]["pid"] != placed[1]["pid"] and after[1]["node"] == placed[1]["node"]
    assert done["world_size"] == 2 and done["resize_log"] == []

    events = client.events(victim["id"])["events"]
    states = [e["to"] for e in events if e["type"] == "state"]
    assert states == ["QUEUED", "PLACING", "RUNNING", "RECOVERING", "RUNNING", "SUCCEEDED"]
    kept = [e for e in events if e["type"] == "survivors_kept"]
    assert len(kept) == 1 and kept[0]["step"] == resumed, kept
    assert f"kept their work at step {resumed}" in kept[0]["message"]
    # Nothing restored from disk, nothing trained twice: the curve only goes forward.
    logs = [r["message"] for r in client.logs(victim["id"])["logs"]]
    assert not [m for m in logs if "restored checkpoint" in m]
    curve = [p["step"] for p in client.metrics(victim["id"]).entries]
    assert curve == sorted(set(curve)) and curve[-1] == 300, curve
    lost = adds_up_to_wall_clock(done)
    assert lost["redone"] == 0 and lost["detection"] > 0 and lost["recovery"] > 0, lost

    reference = stack.wait_state(clean["id"], DONE, timeout=600)
    assert reference["state"] == "SUCCEEDED" and reference["restarts"] == 0
    assert done["progress"]["loss"] == pytest.approx(reference["progress"]["loss"], rel=1e-6)
