"""Jobs beyond plain DDP, end to end on the shared `kc up` stack: 2 replicas of a 2-stage
1F1B pipeline with ZeRO-1, and a mixture of experts split over 2 expert-parallel ranks
in each of 2 data-parallel groups (ep2 x dp2). A rank is SIGKILLed mid-run; the job
restarts from its layout-independent checkpoint and ends at the loss of an
uninterrupted run."""

from __future__ import annotations

import os
import signal

import pytest

from kuangchao.platform.runtime.procs import alive

from .conftest import wait_for

DONE = {"SUCCEEDED", "FAILED", "CANCELLED"}
LAYOUTS = {
    # name: (model fields, parallel section, what the job log's layout line shows)
    "pp2-zero1": ({"n_layers": 4, "n_heads": 2},
                  {"data_parallel_size": 2, "pipeline_parallel_size": 2, "schedule": "1f1b",
                   "micro_batch_size": 2, "gradient_accumulation_steps": 2, "zero_stage": 1},
                  "dp=2 tp=1 pp=2, schedule 1f1b, ZeRO-1"),
    "moe-ep2-dp2": ({"type": "moe", "n_layers": 2, "n_heads": 2, "n_experts": 4, "top_k": 2,
                     "capacity_factor": 1.0},
                    {"data_parallel_size": 4, "expert_parallel_size": 2, "micro_batch_size": 2},
                    "dp=4 tp=1 pp=1, ep=2: experts"),
}


def hybrid(stack, name: str, layout: str) -> dict:
    model, parallel, _ = LAYOUTS[layout]
    d = stack.job_doc(task={"name": name})
    d["model"].update(model)
    d["parallel"] = dict(parallel)
    d["training"].update(steps=40, seed=5, log_interval=10)
    d["checkpoint"]["interval_steps"] = 10
    return d


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_hybrid_job_recovers_from_a_killed_rank_to_the_uninterrupted_loss(stack, layout):
    # The uninterrupted run trains beside it, on GPUs of its own.
    clean = stack.client.submit(hybrid(stack, f"{layout}-clean", layout))
    victim = stack.client.submit(hybrid(stack, f"{layout}-killed", layout))
    wait_for(lambda: stack.client.get(victim["id"])["progress"]["step"] >= 15, 600,
             "the hybrid job to pass its first checkpoint")
    last_stage = next(p for p in stack.client.get(victim["id"])["placement"] if p["rank"] == 3)
    assert alive(last_stage["pid"])
    os.kill(last_stage["pid"], signal.SIGKILL)
    done = stack.wait_state(victim["id"], DONE, timeout=900)
    assert done["state"] == "SUCCEEDED", done["message"]
    assert done["restarts"] == 1 and done["restart_log"][0]["rank"] == 3
    assert done["restart_log"][0]["resumed_step"] in (10, 20, 30)

    logs = [r["message"] for r in stack.client.logs(victim["id"])["logs"]]
    assert any(LAYOUTS[layout][2] in m for m in logs), \
        [m for m in logs if "training" in m]
    assert any("restored checkpoint" in m for m in logs)
    assert done["checkpoints"], "no checkpoint listed"

    reference = stack.wait_state(clean["id"], DONE, timeout=900)
    assert reference["state"] == "SUCCEEDED" and reference["restarts"] == 0
    assert done["progress"]["loss"] == pytest.approx(reference["progress"]["loss"], rel=1e-6)
