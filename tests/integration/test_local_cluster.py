"""`kc up`, `kc down`, and `ray job submit -- kc train` against a real stack."""

from __future__ import annotations

import json
import os
import re
import resource
import sys
from pathlib import Path

import pytest

from kuangchao.platform.runtime import procs

from .conftest import HERE, ROOT, kc

pytestmark = pytest.mark.integration


def test_kc_up_again_reuses_the_running_stack(stack):
    out = kc("up", "--cluster", str(HERE / "cluster-4x8.yaml"), "--json", env=stack.env)
    assert out.returncode == 0, out.stderr
    assert "already up" in out.stderr
    assert json.loads(out.stdout)["ray_address"] == stack.state["ray_address"]


def test_ray_job_submit_runs_kc_train_and_registers_the_job(stack):
    dash = stack.state["dashboard_url"]
    out = __import__("subprocess").run(
        [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", dash,
         "--working-dir", "examples", "--", "kc", "train", "--config", "tiny-gpt.yaml",
         "--set", "training.steps=12", "--set", "task.name=via-ray-job",
         "--set", "model.d_model=32", "--set", "data.max_bytes=200000"],
        cwd=ROOT, env=stack.env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    jobs = [j for j in stack.client.list() if j["name"] == "via-ray-job"]
    assert len(jobs) == 1
    assert jobs[0]["state"] == "SUCCEEDED" and jobs[0]["driver"] == "external"
    assert jobs[0]["progress"]["step"] == 12


def test_kc_up_and_down_twice_leave_no_process_behind(tmp_path):
    env = {**os.environ, "KC_HOME": str(tmp_path), "KC_REDIS_PREFIX": "kc:"}
    env.pop("KC_REDIS_URL", None)  # exercise the embedded Valkey default
    cluster = tmp_path / "one-node.yaml"
    cluster.write_text("nodes: [{name: solo, gpus: 1, leaf: leaf-0, cpus: 1}]\n")
    args = ["up", "--cluster", str(cluster), "--api-port", "0",
            "--dashboard-port", "0", "--json"]
    try:
        first = kc(*args, env=env)
        assert first.returncode == 0, first.stderr
        state = json.loads(first.stdout)
        assert state["redis_embedded"] and "redis_url" not in state
        second = kc(*args, env=env)
        assert second.returncode == 0 and "already up" in second.stderr
        needles = [state["temp_dir"]]
        assert procs.matching(needles), "kc up started no Ray processes"
        assert procs.alive(state["redis_pid"]) and procs.alive(state["api_pid"])
        # The embedded Valkey is sized for the YAML's one rank slot (the floors), and
        # starts with the open files its maxclients needs, where the hard limit allows.
        assert "maxclients 10000, maxmemory 2048mb for 1 rank slot(s)" in first.stderr
        conf = (tmp_path / "valkey" / "valkey.conf").read_text()
        assert "maxclients 10000\nmaxmemory 2048mb\nmaxmemory-policy noeviction\n" in conf
        limits = Path(f"/proc/{state['redis_pid']}/limits").read_text()
        soft = int(re.search(r"Max open files\s+(\d+)", limits).group(1))
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        assert soft >= (10128 if hard == resource.RLIM_INFINITY else min(10128, hard))
    finally:
        down = kc("down", env=env, timeout=120)
    assert down.returncode == 0 and "stopped" in down.stdout
    assert not {p for p in procs.matching(needles) if procs.alive(p)}
    assert not procs.alive(state["redis_pid"]) and not procs.alive(state["api_pid"])
    again = kc("down", env=env)
    assert again.returncode == 0 and "nothing to stop" in again.stdout


# An SDK user's (or a benchmark's) driver thread: signal handlers can be installed only
# on the main thread, so run_as_driver must not try there, and the job still runs.
_DRIVE_FROM_A_THREAD = """
import json, sys, threading
from kuangchao.platform.runtime.driver import run_as_driver
from kuangchao.platform.spec.jobspec import load_spec_document
doc = load_spec_document("examples/tiny-gpt.yaml")  # resolves its `extends:`
doc["task"]["name"] = "driven-from-a-thread"
doc["training"]["steps"] = 6
doc["model"]["d_model"] = 32
doc.setdefault("data", {})["max_bytes"] = 200000
out = {}
def drive():
    try:
        out["job"] = run_as_driver(doc)
    except BaseException as exc:
        out["error"] = repr(exc)
t = threading.Thread(target=drive)
t.start()
t.join()
print(json.dumps(out))
"""


def test_run_as_driver_works_from_a_thread_other_than_main(stack):
    out = __import__("subprocess").run([sys.executable, "-c", _DRIVE_FROM_A_THREAD], cwd=ROOT,
                                       env=stack.env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "error" not in result, result.get("error")
    assert result["job"]["state"] == "SUCCEEDED", result["job"]
    assert result["job"]["progress"]["step"] == 6
