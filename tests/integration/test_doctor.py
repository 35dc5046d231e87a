"""`kc doctor` against the session's live stack, and against a Redis that was stopped."""

from __future__ import annotations

import json

import pytest

from .conftest import kc
from .private_redis import PrivateRedis

pytestmark = pytest.mark.integration


def doctor(env) -> tuple[int, dict]:
    out = kc("doctor", "--json", env=env, timeout=300)
    assert "Traceback" not in out.stderr, out.stderr
    return out.returncode, json.loads(out.stdout)


def test_doctor_examines_every_node_of_the_live_stack(stack):
    rc, report = doctor(stack.env)
    f = {x["check"]: x for x in report["findings"]}
    assert f["ray-cluster"]["status"] == "ok" and "5 node(s), 32 GPU(s)" in f["ray-cluster"]["message"]
    # This machine and the 5 raylets report the same versions.
    assert f["torch-match"]["status"] == "ok" and "on all 6 node(s)" in f["torch-match"]["message"]
    assert f["redis"]["status"] == "ok" and f["redis-acl"]["status"] == "ok"
    # Judged for the nodes Ray has; an embedded Valkey was sized by kc up for cluster-4x8.yaml
    # (a session Redis of the machine's own is whatever its config says).
    assert {"redis-clients", "redis-memory"} <= set(f)
    if stack.state["redis_embedded"]:
        assert f["redis-clients"]["status"] == "ok", f["redis-clients"]
        assert f["redis-clients"]["message"].startswith("maxclients 10000, ")
        assert "rank slot(s) on" in f["redis-clients"]["message"]
        assert f["redis-memory"]["status"] == "ok", f["redis-memory"]
        assert "of maxmemory 2048 MiB (noeviction)" in f["redis-memory"]["message"]
    assert f["clock"]["status"] == "ok"
    assert f["port-API"]["status"] == "ok" and f["port-Ray dashboard"]["status"] == "ok"
    assert rc == (0 if report["healthy"] else 1)
    assert report["healthy"] == all(x["status"] in ("ok", "info") for x in report["findings"])


def test_doctor_reports_a_stopped_redis_with_the_fix(stack, tmp_path):
    server = PrivateRedis(tmp_path / "redis")
    server.start()
    url = server.url
    server.stop()
    rc, report = doctor({**stack.env, "KC_REDIS_URL": url})
    f = {x["check"]: x for x in report["findings"]}
    assert rc == 1 and not report["healthy"]
    assert f["redis"]["status"] == "fail" and "does not answer" in f["redis"]["message"]
    assert "KC_REDIS_URL" in f["redis"]["fix"]
    text = kc("doctor", env={**stack.env, "KC_REDIS_URL": url}, timeout=300)
    assert text.returncode == 1 and "FAIL redis" in text.stdout and "fix: start Redis" in text.stdout
