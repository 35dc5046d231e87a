"""The edges of the cluster itself, against the live stack: Ray refuses a caller
without the stack's token, and what a job's ranks may write about their
metrics (their scrape target, their job's metrics hash) cannot make the
control plane serve another host or another job's series."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from kuangchao.platform.jobs import keys
from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.observability import metrics as m
from tests.integration.conftest import admin_key

from .conftest import assert_untouched

pytestmark = pytest.mark.integration


def test_ray_refuses_a_caller_without_the_token(stack, tmp_path):
    """Nothing reaches the GCS or the job API without the token; with it, both answer."""
    bare = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    bare["KC_HOME"] = str(tmp_path)  # no cluster.json to find the token through
    code = ("import ray,sys\ntry:\n ray.init(address=sys.argv[1], logging_level='ERROR')\n"
            "except Exception as e:\n print(type(e).__name__, e); sys.exit(3)\nprint('connected')")
    out = subprocess.run([sys.executable, "-c", code, stack.state["ray_address"]], env=bare,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 3 and "connected" not in out.stdout, out.stdout + out.stderr[-2000:]
    dash = stack.state["dashboard_url"]
    assert httpx.get(f"{dash}/api/jobs/", timeout=30).status_code == 401
    token = open(stack.env["RAY_AUTH_TOKEN_PATH"]).read().strip()
    assert httpx.get(f"{dash}/api/jobs/", timeout=30, headers={
        "Authorization": f"Bearer {token}"}).status_code == 200
    # The health probes of compose and the chart stay open.
    assert httpx.get(f"{dash}/api/gcs_healthz", timeout=30).status_code == 200


def test_forged_scrape_targets_and_job_series_are_not_served(stack, victim):
    """A rank can write its own job's target entries and metrics hash (its Redis
    user may); the control plane lists only targets on the rank's own node and
    serves only that job's series from the hash."""
    store = JobStore.from_url(stack.env.get("KC_REDIS_URL") or stack.state["redis_url"],
                              stack.env["KC_REDIS_PREFIX"])
    admin = {"Authorization": f"Bearer {admin_key(stack.env['KC_HOME'])}"}
    url = stack.state["api_url"]
    job = victim["id"]
    forged_job = "someone-else-0000"
    before = store.targets([job])[job]
    store.register_target(job, 0, {"addr": "203.0.113.9:9100", "node": "not-its-node"})
    store.register_target(job, 7, {"addr": "203.0.113.9:9101"})
    store.recorder(job).inc(m.RESTARTS, 5, job=forged_job, cause="node_lost")
    store.add_metric_fields(job, {json.dumps(["kc_store_up", {"job": job}]): 1.0})
    try:
        groups = httpx.get(f"{url}/v1/metrics/targets", headers=admin, timeout=30).json()
        mine = [g for g in groups if g["labels"]["job"] == job]
        assert not any("203.0.113.9" in t for g in groups for t in g["targets"]), groups
        assert all(g["labels"]["rank"] != "7" for g in mine)
        text = httpx.get(f"{url}/metrics", headers=admin, timeout=30).text
        assert forged_job not in text
        assert not [line for line in text.splitlines()
                    if line.startswith("kc_store_up{") and f'job="{job}"' in line]
    finally:
        for rank in ("0", "7"):  # the rank's own entry back, as its exporter wrote it
            if rank in before:
                store.r.hset(keys.targets(store.p, job), rank, before[rank])
            else:
                store.r.hdel(keys.targets(store.p, job), rank)
    assert_untouched(stack, victim)
