"""The token authority against a real Redis: grants, renewal before expiry,
revocation seen by the holder, refusals audited, the signing-key rules."""

from __future__ import annotations

import dataclasses
import time

import pytest

from kuangchao.platform.errors import ClusterError, TokenError
from kuangchao.platform.jobs import keys
from kuangchao.platform.jobs.state import JobRecord, JobState
from kuangchao.platform.security.audit import AuditLog
from kuangchao.platform.security.authority import TokenAuthority, load_signing_key
from kuangchao.platform.security.tokens import generate_key, private_pem
from kuangchao.workers import collectives
from kuangchao.workers.runtime.credentials import TokenHolder

from .conftest import wait_for

pytestmark = pytest.mark.integration
SPEC = {"permission": {"collectives": ["all_reduce", "broadcast", "all_gather"],
                       "token_ttl_seconds": 60},
        "checkpoint": {"path": "/data/ckpt"}}


def authority(store, tmp_path, age_s: float = 0.0) -> TokenAuthority:
    """An authority whose clock runs `age_s` behind, so its tokens are born that old."""
    trail = AuditLog(store, tmp_path / "audit.jsonl")
    return TokenAuthority(store, generate_key(), trail, admin_url=None, job_acl=False,
                          clock=lambda: time.time() - age_s)


def test_grants_carry_the_specs_whitelist_scope_and_ttl(store, tmp_path):
    auth = authority(store, tmp_path)
    store.create(JobRecord(id="job-g1", name="g", spec=SPEC))
    grants = auth.grant_workers("job-g1", {0: (0, 1), 1: (2, 3)})
    claims = auth.verify(grants[1].token)
    assert claims.module == "job-g1/rank-1" and claims.role == "trainer"
    assert claims.interfaces == {"all_reduce", "broadcast", "all_gather", "checkpoint_read",
                                 "checkpoint_write", "heartbeat"}
    assert claims.scope.devices == (2, 3) and claims.scope.checkpoint_prefix == "/data/ckpt/job-g1"
    assert claims.scope.redis_prefix == keys.job(store.p, "job-g1") + ":"
    assert claims.expires_at - claims.issued_at == 60
    assert grants[0].public_key == auth.public_key() and b"PRIVATE" not in grants[0].public_key
    mints = [r for r in auth.trail.read(job="job-g1") if r["action"] == "token.mint"]
    assert {r["principal"] for r in mints} == {"job-g1/rank-0", "job-g1/rank-1"}


def test_a_holder_renews_before_expiry_and_loses_every_right_when_revoked(store, tmp_path):
    # Born 47 s into a 60 s life: renewal is due at 48 s, so within seconds.
    auth = authority(store, tmp_path, age_s=47.0)
    store.create(JobRecord(id="job-r1", name="r", spec=SPEC))
    first = auth.grant_workers("job-r1", {0: ()})[0]
    denied: list[tuple] = []
    holder = TokenHolder(first.token, first.public_key, auth.is_revoked, auth.renew,
                         lambda *a: denied.append(a))
    try:
        first_id = holder.claims.token_id
        wait_for(lambda: holder.token != first.token, 30, "the token to be renewed")
        assert holder.claims.module == "job-r1/rank-0" and auth.is_revoked(first_id)
        collectives.permit("broadcast")  # the renewed token still grants it
        with pytest.raises(TokenError, match="revoked"):
            auth.renew(first.token)  # a renewed token cannot be renewed twice
        store.update("job-r1", lambda j: (dataclasses.replace(j, state=JobState.SUCCEEDED), None))
        assert auth.sweep() == ["job-r1"]  # the job ended: its tokens are revoked
        wait_for(lambda: _refused(), 30, "the holder to see the revocation")
        with pytest.raises(PermissionError, match="revoked"):
            collectives.permit("all_reduce")
    finally:
        holder.stop()
    actions = [(r["action"], r["decision"]) for r in auth.trail.read(job="job-r1")]
    assert ("token.renew", "allow") in actions and ("token.revoke", "allow") in actions
    assert any(r["action"] == "token.renew" and r["decision"] == "deny"
               and r["reason"].startswith("revoked") for r in auth.trail.read(decision="deny"))


def _refused() -> bool:
    try:
        collectives.permit("all_reduce")
        return False
    except PermissionError:
        return True


def test_a_denial_reported_by_a_worker_is_audited_under_its_module(store, tmp_path):
    auth = authority(store, tmp_path)
    store.create(JobRecord(id="job-d1", name="d", spec=SPEC))
    grant = auth.grant_workers("job-d1", {3: ()})[3]
    auth.report_denial(grant.token, "send", "group/world", "denied: may not call send")
    auth.report_denial("forged", "recv", "group/world", "denied: may not call recv")
    recs = auth.trail.read(decision="deny")
    assert {(r["principal"], r["action"]) for r in recs} >= {("job-d1/rank-3", "send"),
                                                            ("unverified", "recv")}


def test_no_default_or_missing_signing_key_outside_dev_mode(tmp_path):
    with pytest.raises(ClusterError, match="KC_SIGNING_KEY_FILE"):
        load_signing_key(None, dev=False)
    assert load_signing_key(None, dev=True)[1].startswith("ephemeral")
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    zero = tmp_path / "zero.pem"
    zero.write_bytes(private_pem(Ed25519PrivateKey.from_private_bytes(bytes(32))))
    with pytest.raises(ClusterError, match="well-known default"):
        load_signing_key(str(zero), dev=True)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a key")
    with pytest.raises(ClusterError, match="cannot use the signing key"):
        load_signing_key(str(junk), dev=False)
    good = tmp_path / "good.pem"
    good.write_bytes(private_pem(generate_key()))
    assert load_signing_key(str(good), dev=False)[1] == str(good)
