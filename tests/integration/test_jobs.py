"""A job's whole life on a real stack: Ray raylets, Redis, gloo."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
import yaml

from kuangchao.api.sdk.client import ApiError
from kuangchao.platform.runtime.procs import alive
from kuangchao.workers.checkpoint.manager import load_model_state
from kuangchao.workers.models.factory import ModelConfig, build_model

from .conftest import wait_for

pytestmark = pytest.mark.integration


def test_ddp_job_succeeds_with_lower_loss_identical_replicas_and_loadable_checkpoint(stack):
    job = stack.client.submit(stack.job_doc())
    assert job["state"] == "QUEUED" and job["world_size"] == 2
    done = stack.wait_state(job["id"], {"SUCCEEDED", "FAILED", "CANCELLED"})
    assert done["state"] == "SUCCEEDED", done["message"]
    prog = done["progress"]
    assert prog["step"] == prog["total_steps"] == 20
    assert prog["loss"] < prog["initial_loss"]
    assert [p["rank"] for p in done["placement"]] == [0, 1]
    assert all(p["pid"] and p["node_id"] for p in done["placement"])
    assert done["started_at"] and done["finished_at"] >= done["started_at"]

    digests = {rec["rank"]: rec["params_sha256"] for rec in stack.client.logs(job["id"])["logs"]
               if "params_sha256" in rec}
    assert set(digests) == {0, 1} and digests[0] == digests[1]

    final = done["checkpoints"][-1]
    assert final["step"] == 20 and final["bytes"] > 0 and Path(final["path"]).is_dir()
    m = stack.job_doc()["model"]
    model = build_model(ModelConfig(type="gpt", n_layers=m["n_layers"], n_heads=m["n_heads"],
                                    d_model=m["d_model"], seq_len=m["seq_len"], vocab_size=256))
    before = model.tok_emb.weight.clone()
    assert load_model_state(final["path"], model)["step"] == 20
    assert not torch.equal(before, model.tok_emb.weight)

    states = [e["to"] for e in stack.client.events(job["id"])["events"] if e["type"] == "state"]
    assert states == ["QUEUED", "PLACING", "RUNNING", "SUCCEEDED"]


def test_cancel_mid_run_removes_workers_and_placement_group(stack, ray_driver):
    job = stack.client.submit(stack.job_doc(training__steps=100_000, task={"name": "to-cancel"}))
    wait_for(lambda: stack.client.get(job["id"])["progress"]["step"] >= 2, 300,
             "the job to make progress")
    pids = [p["pid"] for p in stack.client.get(job["id"])["placement"]]
    assert pids and all(alive(p) for p in pids)
    stack.client.cancel(job["id"])
    done = stack.wait_state(job["id"], {"CANCELLED", "FAILED", "SUCCEEDED"}, timeout=120)
    assert done["state"] == "CANCELLED"
    wait_for(lambda: not any(alive(p) for p in pids), 60, "worker processes to exit")
    from ray.util.placement_group import placement_group_table

    def pg_removed():
        table = placement_group_table()
        # One placement group per data-parallel replica, named after its first rank.
        mine = [pg for pg in table.values() if pg["name"].startswith(f"kc-{job['id']}-r")]
        return mine and all(pg["state"] == "REMOVED" for pg in mine)
    wait_for(pg_removed, 60, "the placement group to be removed")
    with pytest.raises(ApiError) as info:
        stack.client.cancel(job["id"])
    assert info.value.status == 409


def test_malformed_spec_gets_422_with_field_paths(stack):
    resp = httpx.post(f"{stack.state['api_url']}/v1/jobs", json={
        "model": {"n_heads": 12, "d_model": 96, "type": "bert"},
        "parallel": {"tensor_parallel_size": 5}, "optimizer": {"lr": "fast"}}, headers=stack.headers)
    assert resp.status_code == 422
    fields = {d["field"]: d["msg"] for d in resp.json()["detail"]}
    assert "optimizer.lr" in fields
    resp = httpx.post(f"{stack.state['api_url']}/v1/jobs", json={
        "model": {"n_heads": 12, "d_model": 96, "type": "bert"},
        "parallel": {"tensor_parallel_size": 5}}, headers=stack.headers)
    fields = {d["field"]: d["msg"] for d in resp.json()["detail"]}
    assert fields["parallel.tensor_parallel_size"] == "5 does not divide model.n_heads (12)"
    assert "not a built-in model" in fields["model.type"]
    resp = httpx.post(f"{stack.state['api_url']}/v1/jobs", content="training: {steps: [1, 2\n",
                      headers={"Content-Type": "application/yaml", **stack.headers})
    assert resp.status_code == 422 and "YAML" in json.dumps(resp.json())


def test_unknown_job_gets_404(stack):
    resp = httpx.get(f"{stack.state['api_url']}/v1/jobs/no-such-job", headers=stack.headers)
    assert resp.status_code == 404 and "kc list" in resp.json()["detail"]


def test_job_larger_than_cluster_stays_queued_with_reason(stack):
    body = yaml.safe_dump(stack.job_doc(parallel={"data_parallel_size": 64}, task={"name": "too-big"}))
    job = stack.client.submit_yaml(body)  # YAML bodies are accepted as well as JSON
    assert job["name"] == "too-big" and job["world_size"] == 64
    try:
        queued = wait_for(lambda: (j := stack.client.get(job["id"]))["waiting_for"] and j, 60,
                          "a waiting reason")
        assert queued["state"] == "QUEUED"
        assert queued["waiting_for"] == "needs 64 GPUs, the cluster has 32"
        assert queued["queue_position"] == 1
    finally:
        stack.client.cancel(job["id"])
    assert stack.wait_state(job["id"], {"CANCELLED"}, timeout=60)["state"] == "CANCELLED"


def test_entrypoint_that_does_not_import_fails_with_where(stack):
    job = stack.client.submit(stack.job_doc(entrypoint="no_such_module_kc:train"))
    done = stack.wait_state(job["id"], {"FAILED", "SUCCEEDED"})
    assert done["state"] == "FAILED"
    assert "cannot import module 'no_such_module_kc'" in done["message"]


def test_train_function_that_raises_fails_with_remote_traceback(stack):
    # json.loads is a real function that raises TypeError when handed a TrainContext.
    job = stack.client.submit(stack.job_doc(entrypoint="json:loads"))
    done = stack.wait_state(job["id"], {"FAILED", "SUCCEEDED"})
    assert done["state"] == "FAILED" and "TypeError" in done["message"]
    failed = [e for e in stack.client.events(job["id"])["events"] if e.get("to") == "FAILED"]
    assert "Traceback" in failed[0]["message"]
    logs = wait_for(lambda: [r for r in stack.client.logs(job["id"])["logs"]
                             if "Traceback" in r["message"]], 30, "the traceback in the logs")
    assert "TypeError" in logs[0]["message"]


def test_missing_data_path_fails_with_the_path(stack):
    # Under the stack's data root ($KC_HOME/data): a path outside the roots is
    # refused at submission (tests/unit/test_admission.py).
    missing = Path(stack.env["KC_HOME"]) / "data" / "nowhere.bin"
    job = stack.client.submit(stack.job_doc(data={"path": str(missing)}))
    done = stack.wait_state(job["id"], {"FAILED", "SUCCEEDED"})
    assert done["state"] == "FAILED"
    assert f"data.path: '{missing}' does not exist" in done["message"]
