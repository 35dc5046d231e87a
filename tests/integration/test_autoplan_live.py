"""`parallel: auto` on a real stack: the API resolves the layout, the job runs it, and the
job JSON shows the plan with its predicted and measured step time."""

from __future__ import annotations

import json

import httpx
import pytest
import yaml

from kuangchao.api.cli.render import plan_line

from .conftest import kc

pytestmark = pytest.mark.integration

CONTRACT = ["dp", "tp", "pp", "micro_batch", "zero_stage", "recompute", "schedule",
            "memory_gb_per_gpu", "predicted_step_s", "predicted_tflops_per_gpu", "gpu", "gpus"]


def test_auto_job_runs_the_planners_layout_and_shows_predicted_and_measured(stack, tmp_path):
    doc = stack.job_doc(parallel={"auto": True, "gpus": 2, "micro_batch_size": 4},
                        training={"steps": 8, "seed": 7, "log_interval": 2},
                        task={"name": "auto-plan"})
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(doc))
    out = kc("submit", str(path), "--json", env=stack.env)  # validated by the CLI, planned by the API
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)
    plan = job["plan"]
    assert set(CONTRACT) <= set(plan), plan
    assert plan["dp"] * plan["tp"] * plan["pp"] == 2 and plan["gpus"] == 2
    # The test cluster's GPUs are fake: the ranks are priced as CPU processes.
    assert plan["gpu"] == "cpu" and plan["global_batch"] == 8
    par = job["spec"]["parallel"]
    assert par["auto"] is False and par["gpus"] is None and par["global_batch"] is None
    assert (par["data_parallel_size"], par["tensor_parallel_size"],
            par["pipeline_parallel_size"]) == (plan["dp"], plan["tp"], plan["pp"])
    assert job["world_size"] == 2 and job["measured_step_s"] is None

    done = stack.wait_state(job["id"], {"SUCCEEDED", "FAILED", "CANCELLED"})
    assert done["state"] == "SUCCEEDED", done["message"]
    assert done["progress"]["step"] == 8
    assert done["plan"] == plan
    assert isinstance(done["measured_step_s"], float) and done["measured_step_s"] > 0
    line = plan_line(done["plan"], done["measured_step_s"])
    assert "predicted" in line and f"measured {done['measured_step_s']:.3g} s/step" in line
    status = kc("status", job["id"], env=stack.env)
    assert status.returncode == 0 and f"plan         {line}" in status.stdout, status.stdout


def test_auto_spec_that_fits_nowhere_gets_422_naming_parallel_auto(stack):
    huge = {"type": "gpt", "n_layers": 96, "n_heads": 96, "d_model": 12288, "seq_len": 2048,
            "vocab_size": 50257}
    resp = httpx.post(f"{stack.state['api_url']}/v1/jobs", headers=stack.headers, json={
        "task": {"name": "auto-too-big"}, "model": huge,
        "parallel": {"auto": True, "gpus": 1, "gpu": "a100-40gb"}})
    assert resp.status_code == 422, resp.text
    [detail] = resp.json()["detail"]
    assert detail["field"] == "parallel.auto" and detail["loc"] == ["parallel", "auto"]
    assert "fits 1 x a100-40gb" in detail["msg"] and "parallel.gpus" in detail["msg"]
    names = [j["name"] for j in stack.client.list()]
    assert "auto-too-big" not in names  # nothing was stored
