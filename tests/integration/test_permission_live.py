"""Capability tokens in live jobs on the session's stack: a collective outside
the whitelist fails the job with the reason in its events and the audit trail;
ranks reach Redis only as their job's own ACL user."""

from __future__ import annotations

import pytest
import redis

from .conftest import shared_redis_url, wait_for

pytestmark = pytest.mark.integration
CHECK = "kuangchao.workers.comm_check:train"
ALL = ["all_gather", "all_reduce", "barrier", "broadcast", "recv", "reduce_scatter", "send"]


def test_every_whitelisted_collective_runs_through_the_guard(stack):
    doc = stack.job_doc(entrypoint=CHECK, permission={"collectives": ALL},
                        args={"collectives": ALL, "numel": 256}, task={"name": "comm-check"})
    job = stack.wait_state(stack.client.submit(doc)["id"], {"SUCCEEDED", "FAILED"})
    assert job["state"] == "SUCCEEDED", job["message"]
    logged = {line.get("collective") for line in stack.client.logs(job["id"])["logs"]}
    assert set(ALL) <= logged


def test_a_collective_outside_the_whitelist_is_denied_and_the_events_say_why(stack):
    doc = stack.job_doc(entrypoint=CHECK, permission={"collectives": ["all_reduce", "barrier"]},
                        args={"collectives": ["all_reduce", "send"]}, task={"name": "comm-deny"})
    job = stack.wait_state(stack.client.submit(doc)["id"], {"SUCCEEDED", "FAILED"})
    assert job["state"] == "FAILED" and job["restarts"] == 0  # a refusal is not retried
    assert "PermissionError" in job["message"] and "may not call" in job["message"]
    events = stack.client.events(job["id"])["events"]
    denied = [e for e in events if e["type"] == "permission_denied"]
    assert denied, events
    by_iface = {e["interface"]: e for e in denied}
    assert "send" in by_iface and by_iface["send"]["rank"] == 0  # rank 1 tried recv
    assert "may not call send" in by_iface["send"]["message"]
    assert "all_reduce, barrier" in by_iface["send"]["message"]  # what the token does grant
    audit = wait_for(lambda: [r for r in stack.client.audit(job=job["id"], action="deny")
                              if r["action"] in ("send", "recv")], 30, "the audit of the denial")
    assert {r["principal"] for r in audit} <= {f"{job['id']}/rank-0", f"{job['id']}/rank-1"}


def test_ranks_use_their_jobs_redis_user_never_the_admin_credentials(stack):
    admin = redis.Redis.from_url(shared_redis_url() or stack.state["redis_url"], decode_responses=True)
    doc = stack.job_doc(training={"steps": 100000, "seed": 7, "log_interval": 50},
                        task={"name": "acl-user"})
    jid = stack.client.submit(doc)["id"]
    try:
        job = wait_for(lambda: (j := stack.client.get(jid))["state"] == "RUNNING"
                       and j["progress"]["step"] > 0 and j, 180, "the job to train")
        user = f"kc-job-{jid}"
        assert admin.acl_getuser(user) is not None
        clients = wait_for(lambda: [c for c in admin.client_list() if c.get("user") == user],
                           30, "connections as the job's user")
        assert clients  # heartbeats, logs and progress arrive as the job's user
        for p in job["placement"]:
            pid = p.get("pid")
            if pid:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                assert not any(v.startswith(b"KC_REDIS_URL=") for v in env), pid
                assert not any(v.startswith(b"KC_API_KEY=") for v in env), pid
    finally:
        stack.client.cancel(jid)
    stack.wait_state(jid, {"CANCELLED"})
    wait_for(lambda: admin.acl_getuser(f"kc-job-{jid}") is None, 60,
             "the job's Redis user to be removed")


def test_a_revoked_token_stops_the_ranks_collectives(stack, ray_driver):
    """Revoking a running job's tokens (an operator's kill switch) takes every
    collective away within seconds: the job fails with the reason."""
    doc = stack.job_doc(training={"steps": 100000, "seed": 7, "log_interval": 50},
                        task={"name": "revoked"}, fault_tolerance={"max_restarts": 0})
    jid = stack.client.submit(doc)["id"]
    wait_for(lambda: (j := stack.client.get(jid))["state"] == "RUNNING"
             and j["progress"]["step"] > 0, 180, "the job to train")
    authority = ray_driver.get_actor("kc-token-authority", namespace="kuangchao")
    # An operator with the admin Redis holds the control plane's credential.
    admin = redis.Redis.from_url(shared_redis_url() or stack.state["redis_url"], decode_responses=True)
    credential = admin.get(stack.env["KC_REDIS_PREFIX"] + "auth:control")
    assert credential
    # Two ranks, three tokens each: trainer, data_loader and monitor.
    assert ray_driver.get(authority.revoke_job.remote(credential, jid, "revoked by the test")) == 6
    job = stack.wait_state(jid, {"FAILED", "SUCCEEDED", "CANCELLED"}, timeout=120)
    # The ranks' own Redis user went with the tokens, so the controller (not the
    # ranks) records why; the audit trail has the revocation.
    assert job["state"] == "FAILED" and "revoked" in job["message"], job["message"]
    assert any(r["action"] == "token.revoke" and r["reason"].startswith("revoked by the test")
               for r in stack.client.audit(job=jid))
