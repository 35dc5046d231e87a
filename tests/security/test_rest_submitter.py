"""A submitter holding only an API key, against the live stack: each attack of
issue 22 that goes through REST fails with a clear 4xx, nothing is stored, the
victim job of another tenant runs on untouched, and the API keeps answering."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import wait_for

from .conftest import assert_untouched

pytestmark = pytest.mark.integration

SMALL = {"task": {"name": "red"}, "model": {"n_layers": 1, "n_heads": 2, "d_model": 32,
                                            "seq_len": 32},
         "parallel": {"data_parallel_size": 1}, "training": {"steps": 5}}


def alias_bomb() -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    return "\n".join(lines) + "\n"


def red_jobs(stack) -> set[str]:
    return {j.id for j in stack.client.list(limit=10_000) if j.get("tenant") == "red"}


def test_a_key_holder_cannot_reach_beyond_its_tenant_or_its_roles_limits(stack, attacker, victim):
    home = Path(stack.env["KC_HOME"])
    t0, before = time.time() - 1, red_jobs(stack)
    cases = [
        ("priority above the role's ceiling", {**SMALL, "task": {"name": "r", "priority": 10**15}},
         403, "task.priority"),
        ("endless restarts", {**SMALL, "fault_tolerance": {"max_restarts": 10**6}}, 403,
         "max_restarts"),
        ("data beyond the ceiling", {**SMALL, "data": {"max_bytes": 1 << 45}}, 403,
         "data.max_bytes"),
        ("the stack's credentials as data", {**SMALL, "data": {"path": str(home / "credentials")}},
         422, "outside the folders jobs may use"),
        ("checkpoints into shared memory", {**SMALL, "checkpoint": {"path": "/dev/shm/red"}}, 422,
         "outside the folders jobs may use"),
        ("checkpoints outside $KC_HOME", {**SMALL, "checkpoint": {
            "path": str(Path(victim["spec"]["checkpoint"]["path"]).parent.parent / "x")}}, 422,
         "outside the folders jobs may use"),
    ]
    for what, doc, status, says in cases:
        resp = attacker.post("/v1/jobs", json=doc)
        assert resp.status_code == status and says in resp.text, (what, resp.status_code, resp.text)
    assert red_jobs(stack) == before
    # Each refusal of the role's ceilings is in the audit trail, under the key's name.
    denied = [r for r in stack.client.audit(since=t0, action="job.submit")
              if r["decision"] == "deny" and r["principal"].startswith("mallory[red/")]
    assert len(denied) == 3, denied
    assert_untouched(stack, victim)


def test_the_victim_is_invisible_and_its_keys_unreachable(stack, attacker, victim):
    vid = victim["id"]
    missing = attacker.get("/v1/jobs/nope-00000000")
    for path in (f"/v1/jobs/{vid}", f"/v1/jobs/{vid}:events", f"/v1/jobs/{vid}:*",
                 f"/v1/jobs/{vid}/logs", f"/v1/jobs/{vid}:progress/logs"):
        resp = attacker.get(path)
        assert resp.status_code == missing.status_code == 404, (path, resp.text)
    assert attacker.post(f"/v1/jobs/{vid}/cancel").status_code == 404
    assert attacker.patch(f"/v1/jobs/{vid}", json={"replicas": 1}).status_code == 404
    assert attacker.post(f"/v1/jobs/{vid}/debug/comm", json={"timeout_s": 1}).status_code == 404
    assert all(j["id"] != vid for j in attacker.get("/v1/jobs").json()["jobs"])
    assert attacker.put("/v1/queues", json={"queues": [{"name": "default"}]}).status_code == 403
    assert attacker.get("/v1/audit").status_code == 403
    assert_untouched(stack, victim)


def test_hostile_bodies_are_refused_at_the_edge_and_the_api_keeps_answering(stack, attacker,
                                                                            victim):
    url, before = stack.state["api_url"], red_jobs(stack)
    # Without a key, a malformed body gets 401, never a 422 that describes the route.
    for method, path in (("PUT", "/v1/queues"), ("POST", "/v1/jobs"), ("POST", "/v1/admin/keys")):
        resp = httpx.request(method, url + path, content=b"{", timeout=30)
        assert resp.status_code == 401, (method, path, resp.text)
    # A body over the limit, declared or streamed, is not read.
    assert attacker.post("/v1/jobs", content=b"#" * ((1 << 20) + 1)).status_code == 413
    streamed = attacker.post("/v1/jobs", content=iter([b"#" * (1 << 19)] * 3))
    assert streamed.status_code == 413
    # An alias bomb is refused fast (bench/api.py times it), and nothing is queued.
    t0 = time.monotonic()
    bomb = attacker.post("/v1/jobs", content=alias_bomb(),
                         headers={"Content-Type": "application/yaml"})
    assert bomb.status_code == 422 and "expands to more than" in bomb.text
    assert time.monotonic() - t0 < 60, "the bomb went off"
    # A flood of bad keys leaves a bounded trail.
    for _ in range(200):
        assert httpx.get(url + "/v1/jobs", headers={"Authorization": "Bearer nope"},
                         timeout=30).status_code == 401
    assert red_jobs(stack) == before
    wait_for(lambda: stack.client.health()["status"] == "ok", 30, "the API to answer")
    assert_untouched(stack, victim)
