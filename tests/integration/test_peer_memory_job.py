"""Peer-memory checkpoints in a running job, on the shared stack: a rank of a dp2 job
that restores from checkpoints (`elastic.resize: restart`, the in-place path) is
SIGKILLed between two disk checkpoints. The controller started the job's keepers
before the ranks ran and handed every `run` the plan, so the replacement and the
survivor restore the step the keepers hold, newer than the disk's: next to nothing
is redone, the final loss is an uninterrupted run's, and the keepers are gone once
the job has ended. (tests/integration/test_peer_memory.py tests the keepers alone.)
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from kuangchao.platform.protocol.memory_copies import keeper_prefix
from kuangchao.platform.runtime.procs import alive

from .conftest import wait_for
from .test_fault_tolerance import adds_up_to_wall_clock, stop_past_a_checkpoint

pytestmark = pytest.mark.integration

DONE = {"SUCCEEDED", "FAILED", "CANCELLED"}
EVERY = 10  # disk checkpoints; the peers' copies are every step
STEPS = 300


def spec(stack, name: str, in_memory: bool) -> dict:
    d = stack.job_doc(task={"name": name})
    d["training"].update(steps=STEPS, seed=17, log_interval=5)
    d["checkpoint"]["interval_steps"] = EVERY
    if in_memory:
        d["checkpoint"]["in_memory"] = {"interval_steps": 1, "max_mb_per_rank": 64}
        d["elastic"] = {"resize": "restart"}  # replaced in place from a checkpoint
    return d


def keepers_of(ray, job_id: str) -> list[str]:
    prefix = keeper_prefix(job_id)
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)]


def common_copies(ray, job_id: str) -> set[int]:
    """The steps every rank of the job has a copy of, over all its keepers (their stats)."""
    held: dict[str, set[int]] = {}
    prefix = keeper_prefix(job_id)
    for a in ray.util.list_named_actors(all_namespaces=True):
        if not a["name"].startswith(prefix):
            continue
        keeper = ray.get_actor(a["name"], namespace=a["namespace"])
        for rank, steps in ray.get(keeper.stats.remote(), timeout=30)["steps"].items():
            held.setdefault(rank, set()).update(steps)
    return set.intersection(*held.values()) if held else set()


def stop_with_copies_past_the_disk(stack, ray, job_id: str, pid: int,
                                   holds: list[list[float]]) -> int:
    """SIGSTOP rank `pid` past a disk checkpoint at a moment when the keepers already
    hold a step of every rank newer than that checkpoint (on a busy machine the copies
    trail the steps: a copy every step is skipped while the last one is in flight);
    returns the step it stopped at. `holds` gets every try's [stopped at, let go at]."""
    for _ in range(20):
        stopped = stop_past_a_checkpoint(stack, job_id, pid, every=EVERY, holds=holds)
        if any(stopped // EVERY * EVERY < s <= stopped for s in common_copies(ray, job_id)):
            return stopped
        os.kill(pid, signal.SIGCONT)
        holds[-1][1] = time.monotonic()
    raise AssertionError(f"job {job_id}: the keepers never held a step past the disk's")


def test_a_killed_rank_is_restored_from_its_peers_memory_past_the_disk_checkpoint(
        stack, ray_driver):
    client = stack.client
    clean = client.submit(spec(stack, "peer-clean", in_memory=False))
    victim = client.submit(spec(stack, "peer-killed", in_memory=True))
    wait_for(lambda: (j := client.get(victim["id"]))["checkpoints"]
             and j["progress"]["step"] > EVERY, 300, "the job to pass its first checkpoint")
    job = client.get(victim["id"])
    placed = {p["rank"]: p for p in job["placement"]}
    nodes = sorted({p["node"] for p in placed.values()})
    assert sorted(n.removeprefix(keeper_prefix(victim["id"]))
                  for n in keepers_of(ray_driver, victim["id"])) == nodes
    started = [e for e in client.events(victim["id"])["events"] if e["type"] == "peer_memory"]
    assert len(started) == 1 and started[0]["nodes"] == nodes, started
    assert alive(placed[1]["pid"])
    holds: list[list[float]] = []
    stopped = stop_with_copies_past_the_disk(stack, ray_driver, victim["id"], placed[1]["pid"],
                                             holds)
    os.kill(placed[1]["pid"], signal.SIGKILL)

    done = stack.wait_state(victim["id"], DONE, timeout=300)
    assert done["state"] == "SUCCEEDED", done["message"]
    assert done["restarts"] == 1
    entry = done["restart_log"][0]
    disk = stopped // EVERY * EVERY  # the newest disk checkpoint at the kill (or older)
    print(f"killed at step {stopped}; restart entry {entry}")
    assert entry["path"] == "in_place" and entry["kind"] == "died", entry
    assert disk < entry["resumed_step"] <= stopped, entry
    logs = [r["message"] for r in client.logs(victim["id"])["logs"]]
    from_peers = [m for m in logs if re.search(r"restored step \d+ from peer memory", m)]
    assert len(from_peers) == 2, from_peers  # both ranks, one step
    assert all(f"restored step {entry['resumed_step']} from peer memory" in m for m in from_peers)
    assert not [m for m in logs if "restored checkpoint" in m]  # nothing read from disk
    lost = adds_up_to_wall_clock(done)
    step_s = done["goodput"]["productive_s"] / STEPS
    # A disk restore would redo the steps since `disk` (up to nine); from the peers'
    # copy, the step after it and the part-step the kill cut short (with slack for the
    # steps' spread: `step_s` is a mean).
    print(f"redone {lost['redone']:.4f}s, a step {step_s:.4f}s, disk would redo "
          f"{stopped - disk} step(s)")
    # (A push still in flight when the rank was stopped may leave the step before it.)
    behind = stopped - entry["resumed_step"]
    assert behind <= 2, entry
    # A try the helpers let go (a busy machine) held the job in training time; when it
    # fell in the steps the restore undid, the accounting rightly counts it as redone.
    let_go = sum(end - start for start, end in holds if end is not None)
    print(f"tries let go: {len(holds) - 1}, holding the job {let_go:.2f}s")
    assert lost["redone"] <= (behind + 1) * 1.5 * step_s + 0.05 + let_go, lost

    reference = stack.wait_state(clean["id"], DONE, timeout=300)
    assert reference["state"] == "SUCCEEDED" and reference["restarts"] == 0
    assert done["progress"]["loss"] == pytest.approx(reference["progress"]["loss"], rel=1e-6)
    # The job has ended: its keepers (and their copies) are gone.
    wait_for(lambda: not keepers_of(ray_driver, victim["id"]), 60, "the job's keepers to end")
