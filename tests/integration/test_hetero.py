"""Mixed GPU generations on a stack of its own: an H100 node at full speed and an
A100 node at half speed (cluster-mixed.yaml), one logical GPU each.

- Bad input is refused at submission with the field named: an unknown GPU
  type, a tensor-parallel group larger than any single-type NVLink island.
- A job that asks for one type waits for that type rather than take another.
- A mixed job (`heterogeneous: true`) gives the fast rank more samples than the
  slow one; the step's samples are still exactly its block.
- Recovery: the H100 node dies under a mixed job; the job restarts from its
  checkpoint on two A100s, re-balances (now an even split), and ends at the
  loss of an uninterrupted run.
- Live resize: an elastic mixed job loses an A100 node, shrinks live, grows
  onto a new H100 node and re-balances; its loss curve matches a fixed-size
  run's at every logged step.

The uninterrupted reference and both faulted runs train the same spec: the
same samples each step with gradients weighted by sample count, so only the
float32 summation order differs between the layouts.
"""

from __future__ import annotations

import os
import signal

import pytest

from kuangchao.api.sdk.client import ApiError

from .conftest import Stack, kc, raylet_of, small_stack, wait_for
from .test_elastic import check_sample_record, loss_curve

pytestmark = [pytest.mark.integration, pytest.mark.own_stack]

DONE = {"SUCCEEDED", "FAILED", "CANCELLED"}
JOINED = ("node-a2", "node-h2")
# Long enough that the node dies while the job still trains, however fast the steps.
STEPS, GLOBAL_BATCH = 600, 24
# Layouts differ only in float32 summation order (see test_elastic.py's LOSS_RTOL).
LOSS_RTOL = 1e-4


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    with small_stack(tmp_path_factory.mktemp("kcmixed"), "cluster-mixed.yaml", "kcmixed", JOINED) as stack:
        yield stack


def mixed_doc(stack: Stack, name: str, steps: int = STEPS, **elastic) -> dict:
    """Global batch 24 (micro-batch 4 x 3 accumulation x 2 replicas)."""
    d = stack.job_doc(task={"name": name})
    d["parallel"].update(data_parallel_size=2, micro_batch_size=4, gradient_accumulation_steps=3)
    d["resources"] = {"gpu_types": ["h100-80gb", "a100-80gb"], "heterogeneous": True}
    d["training"].update(steps=steps, seed=11, log_interval=20)
    d["checkpoint"]["interval_steps"] = 20  # the first by step 30, where the node dies
    d["data"]["record_samples"] = True
    d["fault_tolerance"] = {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 5,
                            "hang_timeout_s": 60}
    if elastic:
        d["elastic"] = elastic
    return d


def samples_by_node(stack: Stack, job: dict, step: int) -> dict[str, int]:
    """How many samples each node's rank trained on in `step` (the job's placement then)."""
    record = stack.client.samples(job["id"])["samples"]
    node_of = {p["rank"]: p["node"] for p in job["placement"]}
    out: dict[str, int] = {}
    for field, value in record.items():
        s, _dp, rank = map(int, field.split("/"))
        if s == step:
            n = sum(len(range(*map(int, span.split(":")))) for span in value.split(","))
            out[node_of[rank]] = out.get(node_of[rank], 0) + n
    return out


def join(stack: Stack, name: str, gpu_type: str, speed: float | None = None) -> None:
    args = ["node", "join", "--address", stack.state["ray_address"], "--name", name,
            "--leaf", "leaf-0", "--gpus", "1", "--cpus", "2", "--gpu-type", gpu_type]
    if speed is not None:
        args += ["--emulated-speed", str(speed)]
    out = kc(*args, env=stack.env, timeout=300)
    assert out.returncode == 0, out.stderr


def kill_node(job: dict, node: str) -> None:
    victim = next(p for p in job["placement"] if p["node"] == node)
    os.kill(raylet_of(victim["node_id"]), signal.SIGKILL)


def same_loss(stack: Stack, job_id: str, reference: dict[int, float]) -> float:
    ours = loss_curve(stack, job_id)  # a resumed run also logs its first step back
    assert set(reference) <= set(ours), (sorted(ours), sorted(reference))
    return max(abs(ours[s] - reference[s]) / abs(reference[s]) for s in reference)


def test_bad_types_are_refused_and_a_one_type_job_waits_for_its_type(mixed):
    client = mixed.client
    bad = mixed_doc(mixed, "bad-type")
    bad["resources"]["gpu_types"] = ["h100-80gb", "x100-1gb"]
    with pytest.raises(ApiError) as exc:
        client.submit(bad)
    assert exc.value.status == 422 and "resources.gpu_types" in exc.value.describe()
    wide = mixed_doc(mixed, "wide-tp")
    wide["parallel"].update(data_parallel_size=1, tensor_parallel_size=2)
    with pytest.raises(ApiError) as exc:
        client.submit(wide)
    assert exc.value.status == 422 and "parallel.tensor_parallel_size" in exc.value.describe()

    only_a100 = mixed_doc(mixed, "a100-only")
    only_a100["resources"] = {"gpu_types": ["a100-80gb"]}
    job = client.submit(only_a100)
    waiting = wait_for(lambda: (j := client.get(job["id"]))["state"] == "QUEUED"
                       and "a100-80gb" in (j.get("waiting_for") or "") and j, 120,
                       "the one-type job to wait for its pool")
    assert not waiting["placement"], waiting["waiting_for"]
    print(f"a one-type job on a cluster without room of its type waits: {waiting['waiting_for']}")
    client.cancel(job["id"])
    assert mixed.wait_state(job["id"], DONE, timeout=120)["state"] == "CANCELLED"


def test_a_mixed_job_recovers_and_resizes_onto_other_types_to_the_uninterrupted_loss(mixed):
    client = mixed.client
    ref = client.submit(mixed_doc(mixed, "reference"))
    done = mixed.wait_state(ref["id"], DONE, timeout=600)
    assert done["state"] == "SUCCEEDED", done["message"]
    assert {p["node"] for p in done["placement"]} == {"node-h1", "node-a1"}
    check_sample_record(mixed, ref["id"], STEPS, GLOBAL_BATCH)
    # Shares follow the catalogue's speeds from a group's first step; the measured
    # re-balance (a few steps in) may move them by what this busy machine measures.
    counts = samples_by_node(mixed, done, 0)
    assert counts["node-h1"] > counts["node-a1"], counts  # the fast rank takes more
    reference = loss_curve(mixed, ref["id"])

    # Recovery: the H100 node dies; the job waits, then restarts from its checkpoint
    # on two A100s, where the split is even again.
    job = client.submit(mixed_doc(mixed, "recovered"))
    running = wait_for(lambda: (j := client.get(job["id"]))["progress"]["step"] >= 30 and j, 400,
                       "the job to pass its first checkpoint", interval=0.1)
    assert running["state"] == "RUNNING" and running["progress"]["step"] < STEPS // 2, running
    kill_node(running, "node-h1")
    join(mixed, "node-a2", "a100-80gb", speed=0.5)
    done = mixed.wait_state(job["id"], DONE, timeout=600)
    assert done["state"] == "SUCCEEDED", done["message"]
    assert {p["node"] for p in done["placement"]} == {"node-a1", "node-a2"}
    assert done["restarts"] >= 1
    check_sample_record(mixed, job["id"], STEPS, GLOBAL_BATCH)
    counts = samples_by_node(mixed, done, done["restart_log"][-1]["resumed_step"])
    assert counts == {"node-a1": GLOBAL_BATCH // 2, "node-a2": GLOBAL_BATCH // 2}, counts
    worst = same_loss(mixed, job["id"], reference)
    print(f"recovered onto another type: worst relative loss difference {worst:.2e}")
    assert worst <= LOSS_RTOL

    # Live resize: an A100 node dies under an elastic job, which shrinks live and
    # grows onto a new H100; the H100 rank then takes the larger share. It runs until
    # two logged steps past the grow, however many steps the events take (as
    # test_elastic.py does), against a fixed-size run of the same spec to that step.
    long = 100_000
    job = client.submit(mixed_doc(mixed, "resized", steps=long, min_replicas=1, max_replicas=2))
    running = wait_for(lambda: (j := client.get(job["id"]))["state"] == "RUNNING"
                       and j["progress"]["step"] >= 10 and j, 400, "the elastic job to train")
    kill_node(running, "node-a2")
    wait_for(lambda: (j := client.get(job["id"]))["replicas"] == 1 and j["state"] == "RUNNING",
             300, "the job to shrink to 1 replica")
    join(mixed, "node-h2", "h100-80gb")
    grown = wait_for(lambda: (j := client.get(job["id"]))["replicas"] == 2
                     and j["state"] == "RUNNING" and j, 300, "the job to grow onto the new H100")
    assert {p["node"] for p in grown["placement"]} == {"node-a1", "node-h2"}
    upto = (grown["progress"]["step"] // 20 + 2) * 20
    wait_for(lambda: upto in loss_curve(mixed, job["id"]), 300, f"the job to log step {upto}")
    client.cancel(job["id"])
    done = mixed.wait_state(job["id"], DONE, timeout=120)
    assert done["state"] == "CANCELLED", done["message"]
    causes = [(e["from"], e["to"], e["cause"]) for e in done["resize_log"]]
    assert causes[0][:2] == (2, 1) and causes[1] == (1, 2, "grow"), causes
    assert done["restart_log"][0]["path"] == "live", done["restart_log"]
    assert check_sample_record(mixed, job["id"], upto, GLOBAL_BATCH, complete=False) == {1, 2}
    record = client.samples(job["id"])["samples"]
    shrunk_at = min(int(f.split("/")[0]) for f in record if f.split("/")[1] == "1")
    regrown_at = min(int(f.split("/")[0]) for f in record
                     if f.split("/")[1] == "2" and int(f.split("/")[0]) > shrunk_at)
    counts = samples_by_node(mixed, grown, regrown_at)
    assert counts["node-h2"] > counts["node-a1"], counts
    events = client.events(job["id"])["events"]
    assert any(e["type"] == "rebalanced" for e in events), [e["type"] for e in events]

    fixed = client.submit(mixed_doc(mixed, "fixed", steps=long))
    wait_for(lambda: upto in loss_curve(mixed, fixed["id"]), 600, f"the fixed job to log step {upto}")
    client.cancel(fixed["id"])
    assert mixed.wait_state(fixed["id"], DONE, timeout=120)["state"] == "CANCELLED"
    theirs = {s: v for s, v in loss_curve(mixed, fixed["id"]).items() if s <= upto}
    worst = same_loss(mixed, job["id"], theirs)
    print(f"resized live onto another type: worst relative loss difference {worst:.2e} "
          f"over {len(theirs)} logged steps to {upto}")
    assert worst <= LOSS_RTOL
