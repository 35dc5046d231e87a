"""Faults on the shared stack: a worker SIGKILLed or SIGSTOPped, the job's
controller and the scheduler SIGKILLed. Each job still completes, and its
record and events say what happened and how fast it was seen."""

from __future__ import annotations

import os
import signal
import time
import types
import warnings
from pathlib import Path

import pytest

from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.runtime.procs import alive

from .conftest import wait_for

pytestmark = pytest.mark.integration

DONE = {"SUCCEEDED", "FAILED", "CANCELLED"}
STALL_S = 2.0  # rank 0 idle this long, its heartbeat going: it waits on the stopped rank
WAITS_ON_PEERS = {"forward", "collective"}  # the built-in trainer's phases that wait on peers


def spec(stack, name):
    d = stack.job_doc(task={"name": name})
    d["training"].update(steps=300, seed=11, log_interval=50)
    d["checkpoint"]["interval_steps"] = 50
    return d


def test_sigkilled_worker_recovers_to_the_failure_free_loss(stack):
    clean = stack.client.submit(spec(stack, "ft-clean"))
    killed = spec(stack, "ft-killed")
    killed["fault_tolerance"] = {"spare_workers": True}  # training math is the same
    # Replaced in place from the checkpoint: the path a train function that does not
    # resize live takes (the built-in trainer's survivors keep their work otherwise,
    # test_survivors.py).
    killed["elastic"] = {"resize": "restart"}
    victim = stack.client.submit(killed)
    _, rank1 = running_rank(stack, victim["id"], rank=1, min_step=60)
    stop_past_a_checkpoint(stack, victim["id"], rank1["pid"], every=50)
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
    # Replaced in place by the warm spare on its node; survivors kept their processes.
    assert entry["path"] == "in_place" and entry["spare"] is True
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

    # Its goodput accounts for the whole wall-clock time, the kill's cost among it.
    lost = adds_up_to_wall_clock(done)
    assert lost["detection"] > 0 and lost["recovery"] > 0
    assert lost["redone"] > 0  # the steps past entry["resumed_step"], trained twice

    reference = stack.wait_state(clean["id"], DONE, timeout=600)
    assert reference["state"] == "SUCCEEDED" and reference["restarts"] == 0
    assert done["progress"]["loss"] == pytest.approx(reference["progress"]["loss"], rel=1e-6)
    clean_lost = adds_up_to_wall_clock(reference)
    assert clean_lost["detection"] == clean_lost["recovery"] == clean_lost["redone"] == 0


def running_rank(stack, job_id: str, rank: int, min_step: int) -> tuple[dict, dict]:
    """Wait until the job is RUNNING past `min_step` with `rank`'s placed process alive;
    return the job and the rank's placement entry.

    The placement names the pids of the newest start: read while a restart is under way,
    it names a process already gone (the CI failure of a SIGSTOP that found no process).
    An earlier restart is reported as a warning, with its cause, for whoever reads why."""
    def ready():
        job = stack.client.get(job_id)
        if job["state"] in DONE:
            raise AssertionError(f"job {job_id} ended before the fault: {job['message']}")
        slot = next((p for p in job["placement"] if p["rank"] == rank), None)
        ok = (job["state"] == "RUNNING" and job["progress"]["step"] >= min_step
              and slot is not None and slot.get("pid") and alive(slot["pid"]))
        return (job, slot) if ok else None

    job, slot = wait_for(ready, 400, f"job {job_id} to run past step {min_step} "
                         f"with rank {rank}'s process alive")
    if job["restarts"]:
        warnings.warn(f"job {job_id} restarted before the test's fault: {job['restart_log']}",
                      stacklevel=2)
    return job, slot


def stop_past_a_checkpoint(stack, job_id: str, pid: int, every: int,
                           holds: list[list[float]] | None = None) -> int:
    """SIGSTOP rank `pid` (its peers then wait in their next collective) at a step that
    no checkpoint is of, so that killing it costs steps the restore undoes; returns it.

    Rank 0 may still finish one step after the stop: gloo's all-reduce of two ranks can
    complete from what the stopped rank had sent, and on a busy machine rank 0's own part
    can take a second or more. So the step is rank 0's own, read from its beat once the
    beat says rank 0 has neither stepped nor changed phase for STALL_S while its heartbeat
    thread beat on (twice since the stop), in a phase that waits on its peers (forward,
    where the gradient all-reduce runs, or a collective): it waits on the stopped rank.
    Stalled anywhere else, it is only slow (a busy machine), and may yet finish the step.
    Neither the step nor the next is a checkpoint's, so that a survivor that did finish
    one more step still went on past the newest checkpoint. Stopped for a few seconds,
    well inside the heartbeat timeout, so the kill is still what the controller sees; a
    try that does not settle in time (a busy machine) is let go and retried. `holds`, when
    given, gets each try's [stopped at, let go at] (monotonic; the second None for the try
    returned): a try let go stalled the job in training time a later rollback may undo."""
    store = JobStore.from_url(stack.env["KC_REDIS_URL"], stack.env["KC_REDIS_PREFIX"])

    def beat():
        return store.beats(job_id, [0])[0]

    def settled(first: int):
        b = beat()
        return b if (b is not None and b.seq >= first + 2 and b.stalled_s >= STALL_S
                     and b.phase in WAITS_ON_PEERS) else None

    for _ in range(20):
        os.kill(pid, signal.SIGSTOP)
        hold: list = [time.monotonic(), None]
        if holds is not None:
            holds.append(hold)
        first = (beat() or types.SimpleNamespace(seq=-1)).seq
        deadline = time.monotonic() + 7
        while (b := settled(first)) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if b is not None and b.step % every and (b.step + 1) % every:
            return b.step
        os.kill(pid, signal.SIGCONT)
        hold[1] = time.monotonic()
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} stopped only at checkpoint steps")


def adds_up_to_wall_clock(job: dict) -> dict[str, float]:
    """Assert that a finished job's `goodput` splits its wall-clock time (within 1%) with
    an ETTR in (0, 1); return its seconds by cause."""
    g = job["goodput"]
    wall = job["finished_at"] - job["created_at"]
    assert g["wall_s"] == pytest.approx(wall, rel=0.01)
    assert g["productive_s"] + sum(g["by_cause"].values()) == pytest.approx(wall, rel=0.01), g
    assert 0 < g["ettr"] < 1 and g["live"] is False and g["reason"] is None, g
    return g["by_cause"]


def test_stopped_worker_is_detected_as_hung_and_replaced(stack):
    d = spec(stack, "ft-stopped")
    d["training"]["steps"] = 200
    # With a warm spare: it also answers the node probe (is the node still on the network?)
    # that a stopped rank's silence sets off, where a task would need a new process. The
    # survivor waits on the stopped rank, so `peer_wait_timeout_s` fails it well before
    # the heartbeat timeout (set long here, so that only that rule can have failed it).
    d["fault_tolerance"] = {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 15,
                            "peer_wait_timeout_s": 2, "hang_timeout_s": 20,
                            "spare_workers": True}
    job = stack.client.submit(d)
    seen, rank1 = running_rank(stack, job["id"], rank=1, min_step=60)
    before = seen["restarts"]  # 0 unless something outside this test restarted it
    stopped_at = time.time()
    os.kill(rank1["pid"], signal.SIGSTOP)
    try:
        done = stack.wait_state(job["id"], DONE, timeout=600)
    finally:
        if alive(rank1["pid"]):
            os.kill(rank1["pid"], signal.SIGKILL)
    assert done["state"] == "SUCCEEDED", done["message"]
    entry = done["restart_log"][before]
    assert done["restarts"] == before + 1, done["restart_log"]
    # The probe found the node on the network: a rank's fault, not a lost node's.
    assert entry["rank"] == 1 and entry["kind"] in ("expired", "hung"), entry
    assert "stopped" in entry["cause"] and entry.get("unreachable") is None, entry
    assert "while every other rank waited on it" in entry["cause"], entry
    assert entry["kind"] == "expired" and entry["detected_after_s"] < 15, entry
    bound = 20 + 2 * 0.5  # hang_timeout_s plus two heartbeat intervals
    assert entry["detected_after_s"] <= bound
    assert entry["failed_at"] - stopped_at <= bound
    events = stack.client.events(job["id"])["events"]
    stacks = {e["rank"]: e["text"] for e in events if e["type"] == "stacks"}
    assert "state: T (stopped)" in stacks[1]
    # The survivor answered with its Python stacks: it was waiting on the stopped rank.
    assert "Thread" in stacks[0] and "File " in stacks[0]


def test_killed_controller_is_restarted_and_recovers_its_job(stack):
    # Open-ended, so that the kill lands mid-run on a fast machine or a slow one; the test
    # cancels it once the restarted controller has it training past its checkpoint.
    doc = spec(stack, "ft-controller")
    doc["training"]["steps"] = 100_000
    doc["checkpoint"]["interval_steps"] = 500
    job = stack.client.submit(doc)
    running = wait_for(lambda: (j := stack.client.get(job["id"]))["progress"]["step"] >= 520 and j,
                       400, "the job to pass its first checkpoint")
    store = JobStore.from_url(stack.env["KC_REDIS_URL"], stack.env["KC_REDIS_PREFIX"])
    pid = int(store.controller(job["id"]).rsplit("/", 1)[1])
    os.kill(pid, signal.SIGKILL)
    assert running["state"] == "RUNNING", running["state"]
    again = wait_for(lambda: (j := stack.client.get(job["id"]))["state"] == "RUNNING"
                     and j["restarts"] == 1 and j["progress"]["step"] > running["progress"]["step"]
                     and j, 600, "the restarted controller to have the job training again")
    assert again["restart_log"][0]["kind"] == "controller"
    assert int(store.controller(job["id"]).rsplit("/", 1)[1]) != pid
    stack.client.cancel(job["id"])  # the restarted controller answers the cancel too
    done = stack.wait_state(job["id"], DONE, timeout=120)
    assert done["state"] == "CANCELLED" and done["restarts"] == 1, done["message"]


def test_killed_scheduler_comes_back_and_keeps_scheduling(stack, ray_driver):
    running = stack.client.submit(spec(stack, "ft-sched-running"))
    wait_for(lambda: stack.client.get(running["id"])["state"] == "RUNNING", 300, "a running job")
    scheduler = ray_driver.get_actor("kc-scheduler", namespace="kuangchao")
    pid = ray_driver.get(scheduler.info.remote(), timeout=60)["pid"]
    os.kill(pid, signal.SIGKILL)
    later = stack.client.submit(stack.job_doc(task={"name": "ft-sched-later"}))
    # Ray restarts the actor; the new one rebuilds its view from Redis.
    wait_for(lambda: _scheduler_pid(ray_driver, scheduler) not in (None, pid), 120,
             "the scheduler actor to come back")
    for job_id in (running["id"], later["id"]):
        done = stack.wait_state(job_id, DONE, timeout=600)
        assert done["state"] == "SUCCEEDED", done["message"]
    assert stack.client.get(running["id"])["restarts"] == 0


def _scheduler_pid(ray, scheduler):
    try:
        return ray.get(scheduler.info.remote(), timeout=10)["pid"]
    except Exception:
        return None


def test_nan_loss_rolls_back_and_skips_the_batch(stack):
    d = spec(stack, "ft-nan")
    d["training"]["steps"] = 200
    d["fault_tolerance"] = {"inject_nan_at_batches": [70]}
    job = stack.client.submit(d)
    done = stack.wait_state(job["id"], DONE, timeout=600)
    assert done["state"] == "SUCCEEDED", done["message"]
    assert done["progress"]["step"] == 200
    entry = done["restart_log"][0]
    assert done["restarts"] == 1 and entry["kind"] == "numeric" and entry["path"] == "rollback"
    assert entry["resumed_step"] == 50 and "batch 70" in entry["cause"]
    states = [e["to"] for e in stack.client.events(job["id"])["events"] if e["type"] == "state"]
    assert states[-3:] == ["RECOVERING", "RUNNING", "SUCCEEDED"]
    logs = [r["message"] for r in stack.client.logs(job["id"])["logs"]]
    assert any("rolled back to step 50" in m for m in logs)


def test_truncated_newest_checkpoint_is_skipped_on_restore(stack):
    d = spec(stack, "ft-truncated")
    d["training"]["steps"] = 400
    d["elastic"] = {"resize": "restart"}  # every rank is killed: all restore (no survivor)
    job = stack.client.submit(d)
    wait_for(lambda: stack.client.get(job["id"])["progress"]["step"] >= 160, 400,
             "three checkpoints")
    pids = [p["pid"] for p in stack.client.get(job["id"])["placement"]]
    # Freeze every rank: rank 0 alone could still commit a background write that
    # rank 1 had already done its part of, after the listing below.
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        folder = Path(d["checkpoint"]["path"]) / job["id"]
        committed = sorted(p for p in folder.glob("step_*") if (p / "manifest.json").exists())
        newest, previous = committed[-1], committed[-2]
        shard = max(newest.glob("*.distcp"), key=lambda f: f.stat().st_size)
        with shard.open("r+b") as f:
            f.truncate(shard.stat().st_size // 2)
    finally:
        for pid in pids:  # killed while frozen: no write of theirs ever lands
            os.kill(pid, signal.SIGKILL)
    done = stack.wait_state(job["id"], DONE, timeout=600)
    assert done["state"] == "SUCCEEDED", done["message"]
    assert done["restart_log"][0]["resumed_step"] == int(previous.name.split("_")[1])
    skipped = [e for e in stack.client.events(job["id"])["events"]
               if e["type"] == "checkpoint_skipped"]
    assert skipped and newest.name in skipped[0]["message"]
    assert "has" in skipped[0]["message"] and "bytes" in skipped[0]["message"]


def test_control_plane_actors_run_on_the_head_node(stack, ray_driver):
    """A controller on a worker node would die with that node; they live on the head."""
    from ray.util.state import list_actors

    head = next(n["NodeID"] for n in ray_driver.nodes()
                if (n.get("Labels") or {}).get("kc.io/role") == "head")
    # The stack's own dashboard: the state API's own search gives up when it finds
    # more than one cluster on the machine.
    alive = list_actors(address=stack.state["dashboard_url"], filters=[("state", "=", "ALIVE")],
                        limit=1000)
    control = [a for a in alive
               if a.class_name in ("SchedulerService", "RegistryActor", "JobControllerActor")]
    assert {a.class_name for a in control} >= {"SchedulerService", "RegistryActor"}
    assert all(a.node_id == head for a in control), [(a.class_name, a.node_id) for a in control]
