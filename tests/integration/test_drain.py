"""A node drained through Ray's own API (the GCS call `ray drain-node` makes, with a
20 s deadline), on a stack of its own: two nodes of four logical GPUs, a job packed on
one of them.

The job checkpoints at the step boundary after the drain is noticed, yields, and is
placed again on the other node, where it resumes at that step: no step is lost (its
final loss is that of the same job never drained), it never goes FAILED, and the drain
is no failure (no restart, no quarantine). A job submitted once the drain is noticed
is not placed on the draining node, and `kc nodes` shows it draining with its deadline.

Ray shuts a drained node down as soon as nothing runs on it, which would race the check
of `kc nodes`; another driver's actor holds the node, as other work on a real node
would. A local raylet is not killed at a drain's deadline either (on a real cluster
the autoscaler or the cloud does it), so the test kills it then, with a real signal:
nothing the job needs may be left there. That node does not come back, so this module
keeps its stack to itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kuangchao.api.sdk.client import Client
from kuangchao.platform.runtime.ray_connect import ray_token_env

from .conftest import Stack, small_stack, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.own_stack]

DONE = {"SUCCEEDED", "FAILED", "CANCELLED"}
DEADLINE_S = 20
# Long enough that the drain lands mid-training on a fast machine: some 5 ms a step here,
# and the holder's driver may be ready seconds after the ranks, the notice a second later.
STEPS = 2000


@pytest.fixture(scope="module")
def drained(tmp_path_factory):
    with small_stack(tmp_path_factory.mktemp("kcdrain"), "cluster-2x4.yaml", "kcdrain") as stack:
        yield stack


def job_doc(stack: Stack, name: str) -> dict:
    d = stack.job_doc(task={"name": name})
    d["training"].update(steps=STEPS, seed=5, log_interval=100)
    d["checkpoint"]["interval_steps"] = 500
    # Detection is not what this tests: two jobs share a small machine's cores, and a
    # rank late to beat under that load must not turn the drain into a recovery.
    d["fault_tolerance"] = {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 30,
                            "hang_timeout_s": 120}
    return d


def story(client: Client, job_id: str) -> str:
    """The job's state, events and last log lines: what a failed assertion shows."""
    j = client.get(job_id)
    events = [{k: e.get(k) for k in ("ts", "type", "to", "step", "message")}
              for e in client.events(job_id)["events"]]
    lines = [f"{ln.get('rank')} {ln.get('message')}" for ln in client.logs(job_id)["logs"][-40:]]
    return (f"job: {j['state']} {j['progress']} {j['message']}\nevents:\n"
            + "\n".join(map(str, events)) + "\nlogs:\n" + "\n".join(lines))


# The operator's side, as a driver of its own: an actor with a CPU, pinned to the node (the
# node's other work), and, on `drain N` on stdin, the drain itself, with an N s deadline,
# through the GCS call `ray drain-node` makes (without its few seconds of start-up).
OPERATOR = """
import sys, time, ray
from ray.core.generated import autoscaler_pb2
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
address, node_id = sys.argv[1], sys.argv[2]
ray.init(address=address, namespace="kctest-drain", log_to_driver=False, logging_level="ERROR")
holder = ray.remote(num_cpus=1)(type("Holder", (), {"ready": lambda self: True})).options(
    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
ray.get(holder.ready.remote(), timeout=120)
print("ready", flush=True)
for line in sys.stdin:
    deadline_ms = time.time_ns() // 1_000_000 + int(line.split()[1]) * 1000
    accepted, why = ray._raylet.GcsClient(address=address).drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        "kc drain test", deadline_ms)
    print("accepted" if accepted else f"refused: {why}", flush=True)
"""


class Operator:
    """Holds a node busy (Ray shuts a drained node down once idle) and drains it on demand."""

    def __init__(self, stack: Stack, node_id: str) -> None:
        env = {**stack.env, **ray_token_env(stack.state)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", OPERATOR, stack.state["ray_address"], node_id],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def ready(self) -> None:
        assert self.proc.stdout.readline().strip() == "ready", "the holder's actor did not start"

    def drain(self, deadline_s: int) -> None:
        self.proc.stdin.write(f"drain {deadline_s}\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        assert answer == "accepted", f"Ray did not take the drain: {answer!r}"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


def raylets_of(node_id: str) -> list[int]:
    from kuangchao.platform.runtime import procs

    needle = f"--node_id={node_id}"
    return [p for p in procs._all_pids()
            if "/raylet/raylet " in procs._cmdline(p) and needle in procs._cmdline(p)]


def event(client: Client, job_id: str, kind: str) -> dict | None:
    return next((e for e in client.events(job_id)["events"] if e["type"] == kind), None)


def test_a_drained_node_costs_no_step_no_failure_and_gets_no_new_job(drained):
    client: Client = drained.client
    job = client.submit(job_doc(drained, "drain-victim"))
    placement = wait_for(lambda: client.get(job["id"])["placement"], 120, "the job placed")
    node, node_id = placement[0]["node"], placement[0]["node_id"]
    assert {p["node"] for p in placement} == {node}, "the job should be packed on one node"
    operator = Operator(drained, node_id)  # starts while the job's ranks do
    try:
        operator.ready()
        wait_for(lambda: client.get(job["id"])["progress"]["step"] >= 20, 300, "training")
        drained_off(drained, operator, job, node, node_id)
    finally:
        operator.close()


def drained_off(drained: Stack, operator: Operator, job: dict, node: str, node_id: str) -> None:
    client = drained.client
    operator.drain(DEADLINE_S)
    deadline = time.monotonic() + DEADLINE_S
    noticed = wait_for(lambda: event(client, job["id"], "node_draining"), 30, "the drain notice")
    view = wait_for(lambda: (n := {x["name"]: x for x in client.nodes()["nodes"]}[node])
                    ["draining"] and n, 30, "kc nodes to show the drain")
    assert view["drain_deadline"] and view["drain_deadline"] > time.time() - 5
    # Submitted once the drain is known: it must land on the other node.
    other = client.submit(job_doc(drained, "drain-reference"))

    saved = wait_for(lambda: event(client, job["id"], "drain_checkpoint"), DEADLINE_S,
                     "the drain's checkpoint before the deadline")
    assert time.monotonic() < deadline and saved["step"] >= noticed["step"], (
        story(client, job["id"]))
    moved = wait_for(lambda: (j := client.get(job["id"]))["state"] in ("RUNNING", "SUCCEEDED")
                     and j["preemptions"] == 1 and j, 120, "the job placed again")
    assert node not in {p["node"] for p in moved["placement"]}, story(client, job["id"])
    # At the deadline the node goes, as it would on a real cluster.
    time.sleep(max(0.0, deadline - time.monotonic()))
    raylets = raylets_of(node_id)
    assert raylets, "the held node's raylet went before its deadline"
    for pid in raylets:
        os.kill(pid, signal.SIGKILL)

    done = drained.wait_state(job["id"], DONE, timeout=300)
    reference = drained.wait_state(other["id"], DONE, timeout=300)
    assert reference["state"] == "SUCCEEDED", story(client, other["id"])
    assert done["state"] == "SUCCEEDED", story(client, job["id"])
    states = [e["to"] for e in client.events(job["id"])["events"] if e["type"] == "state"]
    assert "FAILED" not in states and "RECOVERING" not in states, story(client, job["id"])
    assert done["restarts"] == 0 and done["preemptions"] == 1, story(client, job["id"])
    assert node not in {p["node"] for p in done["placement"]}
    assert node not in {p["node"] for p in reference["placement"]}
    assert not {n["name"]: n for n in client.nodes()["nodes"]}[node].get("quarantine")
    restored = [r["message"] for r in client.logs(job["id"])["logs"]
                if "restored checkpoint" in r["message"]]
    assert restored and all(f"at step {saved['step']}" in m for m in restored), (
        story(client, job["id"]))
    assert event(client, job["id"], "drained_off")["how"] == "requeue"
    assert done["progress"]["loss"] == pytest.approx(reference["progress"]["loss"], rel=1e-6), (
        story(client, job["id"]))
