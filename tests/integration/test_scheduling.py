"""Topology placement, quotas and preemption on a 4-node x 8-GPU, two-leaf stack."""

from __future__ import annotations

import pytest

from .conftest import wait_for

pytestmark = pytest.mark.integration

DONE = {"SUCCEEDED", "FAILED", "CANCELLED"}


def doc(stack, name, dp=1, tp=1, gpus_per_rank=1, steps=100_000, **sections):
    d = stack.job_doc(task={"name": name, **sections.pop("task", {})}, **sections)
    d["model"]["n_heads"] = 4
    d["parallel"] = {"data_parallel_size": dp, "tensor_parallel_size": tp,
                     "gpus_per_rank": gpus_per_rank, "micro_batch_size": 2}
    d["training"]["steps"] = steps
    return d


def cancel_all(stack, ids):
    for job_id in ids:
        if stack.client.get(job_id)["state"] not in DONE:
            stack.client.cancel(job_id)
    for job_id in ids:
        stack.wait_state(job_id, DONE, timeout=120)


def test_tp_groups_sit_in_one_island_with_the_gpu_ids_workers_received(stack):
    job = stack.client.submit(doc(stack, "tp-islands", dp=2, tp=4, steps=3))
    done = stack.wait_state(job["id"], DONE, timeout=400)
    assert done["state"] == "SUCCEEDED", done["message"]
    placement = done["placement"]
    assert [p["rank"] for p in placement] == list(range(8))
    islands = ({0, 1, 2, 3}, {4, 5, 6, 7})
    for group in (placement[:4], placement[4:]):
        assert len({p["node"] for p in group}) == 1
        ids = {g for p in group for g in p["gpus"]}
        assert ids in islands
    received = {rec["rank"]: rec["gpu_ids"] for rec in stack.client.logs(job["id"])["logs"]
                if "gpu_ids" in rec}
    assert received == {p["rank"]: p["gpus"] for p in placement}


def test_each_tenant_stays_within_its_quota(stack):
    a1 = stack.client.submit(doc(stack, "a1", dp=2, gpus_per_rank=4, task={"queue": "team-a"}))
    ids = [a1["id"]]
    try:
        wait_for(lambda: stack.client.get(a1["id"])["state"] == "RUNNING", 300, "a1 to run")
        a2 = stack.client.submit(doc(stack, "a2", dp=1, gpus_per_rank=4, task={"queue": "team-a"}))
        b1 = stack.client.submit(doc(stack, "b1", dp=2, gpus_per_rank=4, task={"queue": "team-b"}))
        ids += [a2["id"], b1["id"]]
        waiting = wait_for(lambda: (j := stack.client.get(a2["id"]))["waiting_for"] and j, 60,
                           "a2's waiting reason")
        assert waiting["state"] == "QUEUED"
        assert waiting["waiting_for"] == "quota team-a: 8/8 GPUs in use"
        wait_for(lambda: stack.client.get(b1["id"])["state"] == "RUNNING", 300, "b1 to run")
        queues = {q["name"]: q for q in stack.client.queues()["queues"]}
        assert queues["team-a"]["gpus_in_use"] == 8 and queues["team-a"]["queued"] == 1
        assert queues["team-b"]["gpus_in_use"] == 8
        assert stack.client.get(a2["id"])["state"] == "QUEUED"
    finally:
        cancel_all(stack, ids)


def test_high_priority_job_preempts_a_low_priority_one_which_resumes_and_finishes(stack):
    # The high-priority job comes at step 3 and preempts within a second or two; 500
    # steps keep the low one training until then on a fast machine. The low job holds
    # two of the four nodes and the high one needs three, so only preempting it makes
    # room (two ranks train the long part, not four).
    low = stack.client.submit(doc(stack, "low", dp=2, gpus_per_rank=8, steps=500,
                                  task={"priority": "low"},
                                  checkpoint={"interval_steps": 10_000,
                                              "path": stack.job_doc()["checkpoint"]["path"]}))
    ids = [low["id"]]
    try:
        wait_for(lambda: stack.client.get(low["id"])["progress"]["step"] >= 3, 300,
                 "the low-priority job to make progress")
        high = stack.client.submit(doc(stack, "high", dp=3, gpus_per_rank=8, steps=5,
                                       task={"priority": "high"}))
        ids.append(high["id"])
        assert stack.wait_state(high["id"], DONE, timeout=400)["state"] == "SUCCEEDED"
        final = stack.wait_state(low["id"], DONE, timeout=600)
        assert final["state"] == "SUCCEEDED", final["message"]
        assert final["preemptions"] == 1 and final["restarts"] == 0
        assert final["progress"]["step"] == 500
        events = stack.client.events(low["id"])["events"]
        preempted = [e for e in events if e["type"] == "preempt"]
        assert preempted and high["id"] in preempted[0]["message"]
        states = [e["to"] for e in events if e["type"] == "state"]
        assert states == ["QUEUED", "PLACING", "RUNNING", "QUEUED", "PLACING", "RUNNING", "SUCCEEDED"]
        requeue = next(e for e in events if e.get("from") == "RUNNING" and e["to"] == "QUEUED")
        assert "checkpointed and requeued" in requeue["message"]
        step_at_preemption = int(requeue["message"].split("step ")[1].split(";")[0])
        assert 3 <= step_at_preemption < 500
        restored = [r["message"] for r in stack.client.logs(low["id"])["logs"]
                    if "restored checkpoint" in r["message"]]
        assert restored and all(f"at step {step_at_preemption}" in m for m in restored)
    finally:
        cancel_all(stack, ids)
