"""`kc debug` and `kc profile` against running jobs on the session's live stack."""

from __future__ import annotations

import json

import pytest

from .conftest import kc, wait_for

pytestmark = pytest.mark.integration
UNSYNCED = "blocks.0.mlp.up_proj.weight"


def _running_job(stack, name: str, **fault_tolerance) -> str:
    doc = stack.job_doc(training={"steps": 100_000, "seed": 5, "log_interval": 5})
    doc["task"]["name"] = name
    doc["checkpoint"]["interval_steps"] = 1000
    if fault_tolerance:
        doc["fault_tolerance"] = fault_tolerance
    job_id = stack.client.submit(doc)["id"]

    def stepping():
        job = stack.client.get(job_id)
        assert job["state"] not in ("FAILED", "CANCELLED", "SUCCEEDED"), job.get("message")
        return job["state"] == "RUNNING" and (job.get("progress") or {}).get("step", 0) >= 3
    wait_for(stepping, 300, f"job {job_id} to train")
    return job_id


def _stop(stack, job_id: str) -> None:
    stack.client.cancel(job_id)
    stack.wait_state(job_id, {"CANCELLED"}, timeout=300)


def _json(out) -> dict:
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stdout.strip(), f"no report (exit {out.returncode}): {out.stderr}"
    return json.loads(out.stdout)


def test_a_healthy_job_diagnoses_clean_and_profiles_every_rank(stack, tmp_path):
    job_id = _running_job(stack, "debug-healthy")
    try:
        out = kc("debug", "comm", job_id, "--json", env=stack.env, timeout=120)
        comm = _json(out)
        assert out.returncode == 0 and comm["healthy"] and comm["missing"] == []
        for rank in ("0", "1"):
            world = comm["ranks"][rank]["groups"][0]
            assert world["name"] == "world" and world["backend"] == "gloo"
            assert world["ranks"] == [0, 1] and world["rank"] == int(rank)
            assert comm["ranks"][rank]["last"]["op"].startswith("all_reduce")

        out = kc("debug", "memory", job_id, "--json", env=stack.env, timeout=120)
        mem = _json(out)
        assert out.returncode == 0 and set(mem["ranks"]) == {"0", "1"}
        for a in mem["ranks"].values():
            # AdamW: two moments per parameter, plus a step counter each
            params = a["parameters"]
            assert params > 0 and 2 * params <= a["optimizer_state"] < 2.01 * params
            assert a["rss"] > a["parameters"]

        out = kc("debug", "gradient", job_id, "--json", env=stack.env, timeout=180)
        grad = _json(out)
        assert out.returncode == 0, out.stderr
        assert grad["identical"] and grad["max_divergence"] == 0 and grad["ranks"] == 2
        assert grad["params"] > 10 and grad["steps_agree"]

        out = kc("profile", job_id, "--steps", "3", "--out", str(tmp_path), "--json",
                 env=stack.env, timeout=400)
        prof = _json(out)
        assert out.returncode == 0, out.stderr
        for rank in (0, 1):
            trace = json.loads((tmp_path / f"rank{rank}.json").read_text())
            names = {e.get("name", "") for e in trace["traceEvents"]}
            assert any(n.startswith("aten::") for n in names), "no compute events"
            assert any("gloo" in n or "allreduce" in n or "all_reduce" in n for n in names), (
                "no collective events")
            summary = prof["ranks"][str(rank)]
            assert summary["steps"] == 3 and summary["comm_ms"] > 0 and summary["compute_ms"] > 0
            assert summary["top_ops"][0]["self_ms"] > 0
        text = kc("debug", "gradient", job_id, env=stack.env, timeout=180)
        assert text.returncode == 0 and "bit-identical" in text.stdout
    finally:
        _stop(stack, job_id)
    out = kc("debug", "comm", job_id, env=stack.env, timeout=60)
    assert out.returncode == 2 and "RUNNING" in out.stderr


def test_a_replica_that_drifts_gets_its_parameter_named(stack):
    job_id = _running_job(stack, "debug-drift", inject_unsynced_params=[UNSYNCED])
    try:
        out = kc("debug", "gradient", job_id, "--json", env=stack.env, timeout=180)
        grad = _json(out)
        assert out.returncode == 1 and not grad["identical"]
        # Only the parameter left out of the all-reduce differs; every other one agrees.
        assert [row["param"] for row in grad["diverged"]] == [UNSYNCED]
        assert grad["diverged"][0]["divergence"] > 0
        text = kc("debug", "gradient", job_id, env=stack.env, timeout=180)
        assert text.returncode == 1 and UNSYNCED in text.stdout
    finally:
        _stop(stack, job_id)
