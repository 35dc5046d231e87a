"""Faults of the infrastructure under a job, on a stack of its own: Redis
restarted mid-job (a private redis-server with an append-only file, so it
comes back with its data), a node that keeps failing (quarantined after two
failures here: the failed replica moves off it), a node whose heartbeat agent is
SIGKILLed, and a node lost (its raylet SIGKILLed).

Two nodes are all these need (one raylet fewer to start and run): a job packed
on one node moves to the other. The node test runs last: it leaves the cluster
one node short.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from kuangchao.api.sdk.client import Client
from kuangchao.platform.jobs.store import JobStore

from .conftest import HERE, Stack, kc, raylet_of, wait_for
from .private_redis import PrivateRedis

pytestmark = [pytest.mark.integration, pytest.mark.own_stack]

DONE = {"SUCCEEDED", "FAILED", "CANCELLED"}


@pytest.fixture(scope="module")
def infra(tmp_path_factory):
    root = tmp_path_factory.mktemp("kcinfra")
    store = PrivateRedis(root / "redis")
    store.start()
    env = {**os.environ, "KC_HOME": str(root / "home"), "KC_REDIS_URL": store.url,
           "KC_REDIS_PREFIX": f"kcinfra-{uuid.uuid4().hex[:8]}:", "KC_QUARANTINE_FAILURES": "2"}
    env.pop("KC_API_URL", None)
    out = kc("up", "--cluster", str(HERE / "cluster-2x4.yaml"), "--api-port", "0",
             "--dashboard-port", "0", "--json", env=env)
    try:
        assert out.returncode == 0, f"kc up failed:\n{out.stdout}\n{out.stderr}"
        stack = Stack(env, json.loads(out.stdout))
        stack.redis = store
        yield stack
    finally:
        down = kc("down", env=env, timeout=120)
        store.stop()
        assert down.returncode == 0, down.stderr


def job_doc(stack: Stack, name: str, steps: int, interval: int) -> dict:
    d = stack.job_doc(task={"name": name})
    d["training"].update(steps=steps, seed=5, log_interval=100)
    d["checkpoint"]["interval_steps"] = interval
    d["fault_tolerance"] = {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 4,
                            "hang_timeout_s": 60}
    return d


def past_first_checkpoint(stack: Stack, name: str, steps: int) -> tuple[dict, list[dict]]:
    """Submit a job (a checkpoint every 50 steps) and wait until it has one; return it
    and where its ranks run."""
    job = stack.client.submit(job_doc(stack, name, steps=steps, interval=50))
    wait_for(lambda: stack.client.get(job["id"])["progress"]["step"] >= 60, 400,
             "a first checkpoint")
    return job, stack.client.get(job["id"])["placement"]


def checkpoint_steps(stack: Stack, job_id: str) -> list[int]:
    folder = Path(stack.env["KC_HOME"]) / "ckpt" / job_id
    return sorted(int(p.name.split("_")[1]) for p in folder.glob("step_*")
                  if (p / "manifest.json").exists())


def trains_on_then_cancelled(stack: Stack, job_id: str) -> tuple[dict, dict]:
    """Wait until an open-ended job trains 10 steps past its one restart's resumed step,
    cancel it; return it as it trained on, and as it ended (CANCELLED)."""
    moved = wait_for(lambda: (j := stack.client.get(job_id))["state"] == "RUNNING"
                     and j["restarts"] == 1
                     and j["progress"]["step"] > j["restart_log"][0].get("resumed_step", 1e9) + 10
                     and j, 600, "the job to train on elsewhere")
    stack.client.cancel(job_id)
    done = stack.wait_state(job_id, DONE, timeout=120)
    assert done["state"] == "CANCELLED", done["message"]
    return moved, done


def test_redis_restart_mid_job_is_ridden_out(infra):
    client: Client = infra.client
    # Open-ended, so that it trains through the outage on a fast machine or a slow one
    # (some 15 ms a step); the test stops it once what the outage held has been written.
    job = client.submit(job_doc(infra, "infra-redis", steps=100_000, interval=100))
    wait_for(lambda: client.get(job["id"])["progress"]["step"] >= 100, 400, "training to start")
    before = checkpoint_steps(infra, job["id"])
    infra.redis.stop()
    try:
        # Down for longer than a heartbeat timeout (4 s), which must not count as
        # deaths. The ranks train on until their lease lapses; from then on their
        # checkpoints wait for Redis (docs/fault-tolerance.md, 'Fencing').
        time.sleep(6)
    finally:
        infra.redis.start()
    # Back, the ranks read that nobody fenced them, and what waited is written.
    wait_for(lambda: checkpoint_steps(infra, job["id"])[-1:] > before[-1:], 300,
             "a checkpoint after the outage")
    wanted = ("heartbeat to Redis failed", "lease lapsed", "heartbeats resumed")
    wait_for(lambda: all(any(w in r["message"] for r in client.logs(job["id"])["logs"])
                         for w in wanted), 120, "the outage's log lines")  # held, shipped after
    running = client.get(job["id"])
    assert running["state"] == "RUNNING" and running["restarts"] == 0, running["restart_log"]
    client.cancel(job["id"])
    done = infra.wait_state(job["id"], DONE, timeout=120)
    assert done["state"] == "CANCELLED", done["message"]
    assert done["restarts"] == 0, done["restart_log"]
    assert not [e for e in client.events(job["id"])["events"] if e["type"] == "fenced"]


def test_a_node_failing_twice_is_quarantined_and_the_failed_replica_moves_off_it(infra):
    client: Client = infra.client
    # Still training when the second kill comes: it follows the first recovery's
    # first step, well inside 800 steps.
    job, first = past_first_checkpoint(infra, "infra-flaky", steps=800)
    node = first[1]["node"]
    os.kill(first[1]["pid"], signal.SIGKILL)
    # The first failure is repaired on the same node: the rank refilled live there, the
    # survivor keeping its work.
    again = wait_for(lambda: (j := client.get(job["id"]))["state"] == "RUNNING"
                     and j["restarts"] == 1 and j["placement"][1]["pid"] != first[1]["pid"]
                     and j["progress"]["step"] > j["restart_log"][0].get("resumed_step", 1e9)
                     and j, 300, "the first recovery")
    assert again["restart_log"][0]["path"] == "live" and again["placement"][1]["node"] == node
    os.kill(again["placement"][1]["pid"], signal.SIGKILL)
    done = infra.wait_state(job["id"], DONE, timeout=600)
    assert done["state"] == "SUCCEEDED", done["message"]
    # The second failure quarantines the node: the failed replica is placed elsewhere and
    # refilled live there; the survivor keeps its work where it runs (a quarantine only
    # keeps new work off a node).
    second = done["restart_log"][1]
    assert done["restarts"] == 2 and second["path"] == "live" and second["relocated"] == 1, second
    after = {p["rank"]: p for p in done["placement"]}
    assert after[1]["node"] != node and after[0]["pid"] == again["placement"][0]["pid"]
    view = {n["name"]: n for n in client.nodes()["nodes"]}
    assert view[node]["quarantine"] and "2 failures" in view[node]["quarantine"]["reason"]
    events = [e for e in client.events(job["id"])["events"] if e["type"] == "quarantine"]
    assert events and events[0]["node"] == node

    out = kc("node", "release", node, env=infra.env)
    assert out.returncode == 0 and "released" in out.stdout, out.stderr
    assert not {n["name"]: n for n in client.nodes()["nodes"]}[node]["quarantine"]
    out = kc("node", "release", node, env=infra.env)
    assert out.returncode == 2 and "not quarantined" in out.stderr


def test_a_killed_node_agent_is_a_lost_node_and_its_job_moves(infra):
    """A job with node agents: its ranks' beats reach Redis in their agent's record only.
    The agent SIGKILLed, its node is lost to the controller (a dead agent is a lost node,
    docs/fault-tolerance.md): the job is placed elsewhere and trains on."""
    client: Client = infra.client
    d = job_doc(infra, "infra-agent", steps=100_000, interval=50)
    d["fault_tolerance"]["node_agents"] = "on"
    job = client.submit(d)
    store = JobStore.from_url(infra.env["KC_REDIS_URL"], infra.env["KC_REDIS_PREFIX"])

    def relayed():
        j = client.get(job["id"])
        nodes = sorted({p["node"] for p in j["placement"]})
        if j["state"] != "RUNNING" or j["progress"]["step"] < 60 or len(nodes) != 1:
            return None
        record = store.relayed_beats(job["id"], nodes, [])[0][nodes[0]]
        own = store.beats(job["id"], range(len(j["placement"])))
        ok = record and set(record.beats) == {0, 1} and not any(own.values())
        return (j, record) if ok else None

    # Past a checkpoint, both ranks relayed by the one agent, no rank key of their own.
    placed, record = wait_for(relayed, 400, "the job's ranks to be relayed by their agent")
    lost = record.node
    os.kill(record.agent_pid, signal.SIGKILL)

    moved, done = trains_on_then_cancelled(infra, job["id"])
    entry = done["restart_log"][0]
    assert entry["kind"] == "node_lost" and entry["unreachable"] == "agent", entry
    assert f"node agent on {lost} stopped" in entry["cause"] and entry["node"] == lost
    timeout_s = d["fault_tolerance"]["heartbeat_timeout_s"]
    assert entry["detected_after_s"] <= timeout_s + 2 * d["fault_tolerance"]["heartbeat_interval_s"]
    assert lost not in {p["node"] for p in moved["placement"]}
    fenced = [e for e in client.events(job["id"])["events"] if e["type"] == "fenced"]
    assert fenced and set(fenced[0]["ranks"]) == {0, 1}  # the whole node's ranks
    view = {n["name"]: n for n in client.nodes()["nodes"]}
    assert "node agent stopped" in view[lost]["quarantine"]["reason"]
    # The node is sound (only its agent was killed): back into service for the next test.
    out = kc("node", "release", lost, env=infra.env)
    assert out.returncode == 0, out.stderr


def test_lost_node_job_is_placed_elsewhere(infra):
    """An open-ended job, so that it cannot finish before the lost node is noticed
    (a raylet's workers can outlive it by seconds, and 600 steps once finished in
    them); the test stops it once it trains on, placed elsewhere."""
    client: Client = infra.client
    job, placement = past_first_checkpoint(infra, "infra-node", steps=100_000)
    lost = placement[0]["node"]
    assert {p["node"] for p in placement} == {lost}, "the job should be packed on one node"
    os.kill(raylet_of(placement[0]["node_id"]), signal.SIGKILL)

    moved, done = trains_on_then_cancelled(infra, job["id"])
    entry = done["restart_log"][0]
    assert done["restarts"] == 1 and entry.get("node") == lost, done["restart_log"]
    assert entry["kind"] in ("node_lost", "died", "expired")
    assert lost not in {p["node"] for p in moved["placement"]}
    view = {n["name"]: n for n in client.nodes()["nodes"]}
    assert not view[lost]["alive"] or view[lost]["quarantine"]
