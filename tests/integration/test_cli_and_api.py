"""The `kc` CLI against a live stack, and job state surviving an API restart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import yaml

from kuangchao.platform.runtime.procs import alive, port_open

from .conftest import ROOT, kc, wait_for

pytestmark = pytest.mark.integration


def test_kc_submit_wait_json_follows_the_job_and_exits_0(stack, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(stack.job_doc(task={"name": "cli-wait"})))
    out = kc("submit", str(spec), "--wait", "--json", "--set", "training.steps=12", env=stack.env)
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)
    assert job["state"] == "SUCCEEDED" and job["progress"]["step"] == 12
    assert "SUCCEEDED" in out.stderr and "step 12/12" in out.stderr  # progress went to stderr

    status = json.loads(kc("status", job["id"], "--json", env=stack.env).stdout)
    assert status["id"] == job["id"] and status["checkpoints"][-1]["step"] == 12
    listed = json.loads(kc("list", "--json", env=stack.env).stdout)
    assert job["id"] in {j["id"] for j in listed}
    events = json.loads(kc("events", job["id"], "--json", env=stack.env).stdout)
    assert events[-1]["to"] == "SUCCEEDED"
    logs = kc("logs", job["id"], env=stack.env)
    assert logs.returncode == 0 and "[rank 0] step 12/12" in logs.stdout
    # JSON lines carrying job_id, rank and module; --rank keeps one rank's.
    lines = [json.loads(x) for x in kc("logs", job["id"], "--rank", "1", "--json",
                                       env=stack.env).stdout.splitlines()]
    assert lines and {x["rank"] for x in lines} == {1}
    assert all(x["job_id"] == job["id"] and x["module"] for x in lines)
    assert any(x["module"] == "worker" for x in lines)
    train = kc("logs", job["id"], "--module", "train", env=stack.env).stdout
    assert "step 12/12" in train and "pid" not in train  # worker start-up lines are left out
    text = kc("status", job["id"], env=stack.env).stdout
    assert "SUCCEEDED" in text and "rank 1" in text


def test_kc_status_exits_2_for_an_unknown_job(stack):
    out = kc("status", "no-such-job", env=stack.env)
    assert out.returncode == 2 and "no job with id" in out.stderr


def test_jobs_survive_a_restart_of_the_api_server(stack):
    before = {j["id"]: j["state"] for j in stack.client.list()}
    assert before, "earlier tests should have left jobs behind"
    pid, port = stack.state["api_pid"], stack.state["api_port"]
    if alive(pid):
        os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not port_open(port), 30, "the API server to stop")
    # As `kc up` started it: the same metrics token and scrape-target file.
    env = {**stack.env, "KC_RAY_ADDRESS": stack.state["ray_address"],
           "KC_METRICS_TOKEN_FILE": stack.state["metrics_token_file"],
           "KC_METRICS_SD_FILE": stack.state["metrics_sd_file"]}
    log = open(os.path.join(stack.env["KC_HOME"], "logs", "api-restarted.log"), "ab")
    proc = subprocess.Popen([sys.executable, "-m", "kuangchao.api.server", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    stack.state["api_pid"] = proc.pid
    wait_for(lambda: port_open(port), 60, "the restarted API server")
    after = {j["id"]: j["state"] for j in stack.client.list()}
    assert set(before) <= set(after)
    finished = {"SUCCEEDED", "FAILED", "CANCELLED"}
    assert {k: after[k] for k, v in before.items() if v in finished} == {
        k: v for k, v in before.items() if v in finished}
