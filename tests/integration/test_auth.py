"""API keys, roles, tenants and the audit trail, against the session's live stack."""

from __future__ import annotations

import json
import os
import stat
import uuid
from pathlib import Path

import httpx
import pytest

from kuangchao.api.sdk.client import ApiError, Client

from .conftest import kc, wait_for

pytestmark = pytest.mark.integration


def url(stack, path: str) -> str:
    return f"{stack.state['api_url']}{path}"


def new_key(stack, tenant: str, role: str, **kw) -> str:
    return stack.client.create_key(f"{role}-{tenant}", tenant, role, **kw)["key"]


def status_of(fn, *args) -> int:
    with pytest.raises(ApiError) as info:
        fn(*args)
    return info.value.status


def denials(stack, **kw) -> list[dict]:
    return stack.client.audit(action="deny", **kw)


@pytest.fixture(scope="module")
def tenants(stack):
    """Two tenants, each with a queued job (too big to ever run), and keys of each role."""
    a, b = f"ta-{uuid.uuid4().hex[:6]}", f"tb-{uuid.uuid4().hex[:6]}"
    keys = {(label, r): new_key(stack, t, r) for label, t in (("a", a), ("b", b))
            for r in ("viewer", "submitter")}
    keys[("ops", "operator")] = new_key(stack, "ops", "operator")
    big = stack.job_doc(parallel={"data_parallel_size": 64}, task={"name": "tenant-job"})
    job_a = Client(stack.state["api_url"], keys[("a", "submitter")]).submit(big)
    job_b = Client(stack.state["api_url"], keys[("b", "submitter")]).submit(big)
    yield {"a": a, "b": b, "keys": keys, "job_a": job_a["id"], "job_b": job_b["id"]}
    for j in (job_a, job_b):
        try:
            stack.client.cancel(j["id"])
        except ApiError:
            pass


def as_(stack, tenants, label: str, role: str) -> Client:
    return Client(stack.state["api_url"], tenants["keys"][(label, role)])


def test_every_route_but_healthz_needs_a_key_and_says_why(stack):
    assert httpx.get(url(stack, "/healthz")).status_code == 200
    for path in ("/v1/jobs", "/v1/nodes", "/v1/queues", "/openapi.json", "/v1/audit",
                 "/v1/admin/keys", "/v1/whoami", "/metrics"):
        resp = httpx.get(url(stack, path))
        assert resp.status_code == 401, path
        assert "missing" in resp.json()["detail"] and resp.headers["www-authenticate"] == "Bearer"
    key = stack.key
    tampered = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    reasons = {}
    for label, header in (("malformed", "Bearer letmein"), ("malformed", "Basic dXNlcjpwYXNz"),
                          ("tampered", f"Bearer {tampered}"),
                          ("unknown", "Bearer kc_0123456789abcdef_" + "x" * 43)):
        resp = httpx.get(url(stack, "/v1/jobs"), headers={"Authorization": header})
        assert resp.status_code == 401
        reasons[label] = resp.json()["detail"]
        assert label in reasons[label]
    assert httpx.get(url(stack, "/openapi.json"), headers=stack.headers).status_code == 200
    recorded = {r["reason"].split(":")[0] for r in denials(stack, limit=50)
                if r["action"] == "api.authenticate"}
    assert {"missing", "malformed", "tampered", "unknown"} <= recorded


def test_revoked_and_expired_keys_are_refused_and_audited(stack):
    key = new_key(stack, "rv", "viewer")
    c = Client(stack.state["api_url"], key)
    assert c.whoami()["role"] == "viewer"
    key_id = c.whoami()["key_id"]
    stack.client.revoke_key(key_id)
    assert status_of(c.list) == 401
    short = Client(stack.state["api_url"], new_key(stack, "ex", "viewer", ttl_s=1.5))
    wait_for(lambda: _refused(short), 30, "the short-lived key to expire")
    reasons = [r["reason"] for r in denials(stack, limit=50) if r["action"] == "api.authenticate"]
    assert any(r.startswith(f"revoked: key {key_id}") for r in reasons)
    assert any(r.startswith("expired") for r in reasons)
    listed = {k["key_id"]: k for k in stack.client.keys(include_revoked=True)}
    assert listed[key_id]["revoked_at"] is not None
    assert key_id not in {k["key_id"] for k in stack.client.keys()}


def _refused(c: Client) -> bool:
    try:
        c.list()
        return False
    except ApiError as exc:
        return exc.status == 401


def test_roles_viewer_cannot_submit_or_cancel_and_is_audited(stack, tenants):
    viewer = as_(stack, tenants, "a", "viewer")
    assert tenants["job_a"] in {j["id"] for j in viewer.list()}
    assert status_of(viewer.submit, stack.job_doc()) == 403
    assert status_of(viewer.cancel, tenants["job_a"]) == 403
    assert status_of(viewer.create_key, "x", "y", "admin") == 403
    assert status_of(viewer.audit) == 403
    assert status_of(as_(stack, tenants, "a", "submitter").release_node, "no-such") == 403
    operator = as_(stack, tenants, "ops", "operator")
    assert status_of(operator.release_node, "no-such") == 404  # allowed, but nothing to release
    assert status_of(operator.create_key, "x", "y", "admin") == 403
    denied = {(r["action"], r["reason"]) for r in denials(stack, limit=100)}
    assert ("job.submit", "role viewer may not job.submit") in denied
    assert ("job.cancel", "role viewer may not job.cancel") in denied
    assert ("node.manage", "role submitter may not node.manage") in denied


def test_a_tenant_never_learns_of_another_tenants_jobs(stack, tenants):
    b_sub = as_(stack, tenants, "b", "submitter")
    job_a = tenants["job_a"]
    assert job_a not in {j["id"] for j in b_sub.list()}
    assert tenants["job_b"] in {j["id"] for j in b_sub.list()}
    missing = status_of(b_sub.get, "no-such-job-at-all")
    for fn, args in ((b_sub.get, (job_a,)), (b_sub.cancel, (job_a,)), (b_sub.logs, (job_a,)),
                     (b_sub.events, (job_a,)), (b_sub.samples, (job_a,)),
                     (b_sub.scale, (job_a, 2))):
        with pytest.raises(ApiError) as info:
            fn(*args)
        assert info.value.status == missing == 404
        assert info.value.detail == f"no job with id {job_a!r}; `kc list` shows the known jobs"
    assert stack.client.get(job_a)["state"] == "QUEUED"  # the attempts changed nothing
    job = as_(stack, tenants, "a", "viewer").get(job_a)
    assert job["tenant"] == tenants["a"] and job["owner"] == f"submitter-{tenants['a']}"
    hidden = [r for r in denials(stack, job=job_a) if r["reason"].startswith("job belongs to")]
    assert {r["action"] for r in hidden} >= {"job.read", "job.cancel", "job.scale"}
    # The admin sees every tenant; the job's own submitter may cancel it.
    assert job_a in {j["id"] for j in stack.client.list()}
    assert as_(stack, tenants, "a", "submitter").cancel(job_a)["state"] == "CANCELLED"
    allowed = [r for r in stack.client.audit(job=job_a, action="allow")]
    assert [r["action"] for r in allowed] == ["job.submit", "job.cancel"]


def test_queues_are_managed_by_operators(stack, tenants):
    operator, viewer = as_(stack, tenants, "ops", "operator"), as_(stack, tenants, "a", "viewer")
    current = stack.client.queues()
    doc = {"queues": [{k: q[k] for k in ("name", "guaranteed_gpus", "borrow_limit_gpus")}
                      for q in current["queues"]],
           "preemption": current["preemption"], "policy": current["policy"]}
    assert status_of(viewer.put_queues, doc) == 403
    with pytest.raises(ApiError) as info:
        operator.put_queues({**doc, "policy": "lottery"})
    assert info.value.status == 422 and info.value.detail[0]["field"] == "policy"
    assert operator.put_queues(doc)["queues"] == current["queues"]


def test_metrics_need_the_scrape_token_or_an_operator(stack, tenants):
    token = Path(stack.state["metrics_token_file"]).read_text().strip()
    # A request to a job's route of our own, not one some earlier test may have made.
    assert stack.client.get(tenants["job_a"])["id"] == tenants["job_a"]
    resp = httpx.get(url(stack, "/metrics"), headers={"Authorization": f"Bearer {token}"})
    assert resp.status_code == 200 and "kc_api_request_duration_seconds" in resp.text
    assert 'route="/v1/jobs/{job_id}"' in resp.text  # labelled by route, not by raw path
    viewer = {"Authorization": f"Bearer {tenants['keys'][('a', 'viewer')]}"}
    assert httpx.get(url(stack, "/metrics"), headers=viewer).status_code == 403
    assert httpx.get(url(stack, "/metrics"), headers=stack.headers).status_code == 200


def test_cli_keys_audit_and_the_private_credentials_file(stack, tmp_path):
    home = Path(stack.env["KC_HOME"])
    for name in ("credentials", "signing-key.pem", "metrics-token", "cluster.json"):
        assert stat.S_IMODE(os.stat(home / name).st_mode) == 0o600, name
    out = kc("admin", "key", "create", "--tenant", "cli-t", "--role", "submitter", "--json",
             env=stack.env)
    assert out.returncode == 0, out.stderr
    made = json.loads(out.stdout)
    assert made["role"] == "submitter" and made["key"].startswith("kc_")
    listed = kc("admin", "key", "list", "--json", env=stack.env)
    assert made["key_id"] in {k["key_id"] for k in json.loads(listed.stdout)}
    assert "key" not in json.loads(listed.stdout)[0]  # never the key itself
    as_sub = {**stack.env, "KC_API_KEY": made["key"]}
    denied = kc("admin", "key", "list", env=as_sub)
    assert denied.returncode == 2 and "role submitter may not key.manage" in denied.stderr
    bad = kc("admin", "key", "create", "--tenant", "t", "--role", "root", env=stack.env)
    assert bad.returncode == 2 and "admin, operator, submitter, viewer" in bad.stderr
    assert kc("admin", "key", "revoke", made["key_id"], env=stack.env).returncode == 0
    gone = kc("list", env=as_sub)
    assert gone.returncode == 2 and "revoked" in gone.stderr and "Traceback" not in gone.stderr
    trail = kc("audit", "--action", "deny", "--since", "10m", "--json", env=stack.env)
    records = json.loads(trail.stdout)
    assert records and {r["decision"] for r in records} == {"deny"}
    assert any(r["reason"].startswith(f"revoked: key {made['key_id']}") for r in records)
    assert {"ts", "principal", "action", "resource", "decision", "reason"} <= set(records[0])
    bad_since = kc("audit", "--since", "yesterday-ish", env=stack.env)
    assert bad_since.returncode == 2 and "not a time" in bad_since.stderr
    # The same records reach the JSONL file.
    lines = (home / "audit" / "audit.jsonl").read_text().splitlines()
    assert any(made["key_id"] in json.loads(x)["resource"] for x in lines)


def test_kc_up_refuses_a_default_or_unreadable_signing_key(tmp_path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from kuangchao.platform.security.tokens import private_pem

    default = tmp_path / "default.pem"
    default.write_bytes(private_pem(Ed25519PrivateKey.from_private_bytes(bytes([7]) * 32)))
    env = {**os.environ, "KC_HOME": str(tmp_path / "home"),
           "KC_REDIS_PREFIX": f"kctest-key-{uuid.uuid4().hex[:6]}:"}
    env.pop("KC_API_URL", None)
    for path, says in ((default, "well-known default"), (tmp_path / "absent.pem", "cannot use")):
        out = kc("up", "--cluster", "examples/cluster-2x4.yaml", "--api-port", "0",
                 "--dashboard-port", "0", env={**env, "KC_SIGNING_KEY_FILE": str(path)},
                 timeout=120)
        assert out.returncode == 2 and says in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and "KC_SIGNING_KEY_FILE" in out.stderr
        assert not (tmp_path / "home" / "cluster.json").exists()  # nothing left running
