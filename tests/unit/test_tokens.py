"""Capability tokens: minting, checking, and default deny."""

import base64
import json

import pytest

from kuangchao.platform.errors import TokenError
from kuangchao.platform.security.tokens import (
    Minter,
    Scope,
    Verifier,
    check,
    generate_key,
    load_private,
    load_public,
    private_pem,
    public_pem,
    within_prefix,
)

SCOPE = Scope(devices=(0,), groups=("dp",), checkpoint_prefix="/ckpt/job-1",
              redis_prefix="kc:job:job-1:")
NOW = 1_000_000.0


def minted(role="trainer", interfaces=("all_reduce", "checkpoint_write"), ttl_s=60.0, key=None):
    key = key or generate_key()
    token, claims = Minter(key).mint("job-1/rank-0", "job-1", role, SCOPE, interfaces, ttl_s,
                                     now=NOW)
    return key, token, claims


def verifier(key, now=NOW + 1, revoked=()):
    return Verifier(load_public(public_pem(key)), is_revoked=lambda tid: tid in revoked,
                    clock=lambda: now)


def reason(fn) -> str:
    with pytest.raises(TokenError) as info:
        fn()
    assert isinstance(info.value, PermissionError)
    return info.value.reason


def test_a_token_checks_out_with_the_public_key_alone():
    key, token, claims = minted()
    got = verifier(key).verify(token)
    assert got == claims and got.scope == SCOPE and "all_reduce" in got.interfaces
    check(got, "all_reduce", group="dp", device=0)
    assert load_private(private_pem(key)).public_key() is not None


def test_missing_malformed_expired_tampered_and_revoked_tokens_are_refused():
    key, token, claims = minted(ttl_s=60)
    v = verifier(key)
    assert reason(lambda: v.verify(None)) == "missing"
    assert reason(lambda: v.verify("not.a.token")) == "malformed"
    assert reason(lambda: verifier(key, now=NOW + 60).verify(token)) == "expired"
    head, body, sig = token.split(".")
    payload = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    payload["scope"]["groups"] = ["dp", "pp"]  # widen the scope, keep the signature
    forged_body = base64.urlsafe_b64encode(json.dumps(payload).encode()).rstrip(b"=").decode()
    assert reason(lambda: v.verify(f"{head}.{forged_body}.{sig}")) == "tampered"
    _, other, _ = minted(key=generate_key())  # signed by someone else's key
    assert reason(lambda: v.verify(other)) == "tampered"
    assert reason(lambda: verifier(key, revoked={claims.token_id}).verify(token)) == "revoked"


def test_default_deny_outside_the_whitelist_and_the_scope():
    key, token, _ = minted(interfaces=("all_reduce",))
    claims = verifier(key).verify(token)
    assert reason(lambda: check(claims, "broadcast")) == "denied"
    assert reason(lambda: check(claims, "all_reduce", group="pp")) == "denied"
    assert reason(lambda: check(claims, "all_reduce", device=3)) == "denied"


def test_a_role_is_never_granted_more_than_it_may_have():
    with pytest.raises(ValueError, match="may not be granted"):
        minted(role="monitor", interfaces=("all_reduce",))
    with pytest.raises(ValueError, match="unknown"):
        minted(role="root")


def test_tokens_renew_once_most_of_their_life_has_passed():
    _, _, claims = minted(ttl_s=100)
    assert not claims.needs_renewal(NOW + 50) and claims.needs_renewal(NOW + 81)


def test_checkpoint_paths_stay_inside_the_prefix():
    assert str(within_prefix("/ckpt/job-1", "step_00000010")) == "/ckpt/job-1/step_00000010"
    assert str(within_prefix("/ckpt/job-1", "/ckpt/job-1/step_1")) == "/ckpt/job-1/step_1"
    for bad in ("../job-2/step_1", "/ckpt/job-1/../job-2", "/ckpt/job-10/step_1", "/etc/passwd"):
        assert reason(lambda b=bad: within_prefix("/ckpt/job-1", b)) == "denied"
    assert reason(lambda: within_prefix("", "x")) == "denied"
