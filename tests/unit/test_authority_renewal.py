"""Renewal only trades a token this authority issued, for a live job, and a
renewal that races `revoke_job` leaves no token behind (gap 12 of issue 22).
On the in-memory store."""

from __future__ import annotations

import dataclasses

import pytest

from kuangchao.platform.errors import TokenError
from kuangchao.platform.jobs.state import JobState
from kuangchao.platform.spec.jobspec import JobSpec
from tests.unit.authority_fakes import live_authority

SPEC = {"permission": {"collectives": ["all_reduce"], "token_ttl_seconds": 600}}


@pytest.fixture
def auth(tmp_path):
    return live_authority(tmp_path, SPEC)


def test_a_live_jobs_issued_token_renews_once(auth):
    token = auth.grant_workers("job-a", {0: ()})[0].token
    new = auth.renew(token)
    assert auth.verify(new).module == "job-a/rank-0"
    with pytest.raises(TokenError, match="revoked"):
        auth.renew(token)


def test_a_token_signed_with_the_key_but_never_issued_is_not_renewed(auth):
    scope = auth.trainer_scope("job-a", JobSpec.model_validate(SPEC), ())
    forged, _ = auth._minter.mint("job-a/rank-9", "job-a", "trainer", scope,
                                  frozenset({"all_reduce"}), 600)
    with pytest.raises(TokenError, match="was not issued for job job-a"):
        auth.renew(forged)
    assert not auth.store.issued_tokens("job-a")


def test_the_token_of_an_ended_job_is_not_renewed(auth):
    token = auth.grant_workers("job-a", {0: ()})[0].token
    auth.store.update("job-a", lambda j: (dataclasses.replace(j, state=JobState.SUCCEEDED), None))
    with pytest.raises(TokenError, match="has ended"):
        auth.renew(token)


def test_a_renewal_racing_revoke_job_leaves_no_live_token(auth, monkeypatch):
    """`revoke_job` reads the issued tokens while a renewal mints its new one."""
    token = auth.grant_workers("job-a", {0: ()})[0].token
    mint = auth._mint
    minted: list = []

    def mint_then_revoke_the_job(*args, **kwargs):
        auth.revoke_job("job-a", "kill switch")  # runs between the renewal's checks and mint
        out = mint(*args, **kwargs)
        minted.append(out[1])
        return out
    monkeypatch.setattr(auth, "_mint", mint_then_revoke_the_job)
    with pytest.raises(TokenError, match="has ended|revoked"):
        auth.renew(token)
    (fresh,) = minted
    assert auth.is_revoked(fresh.token_id), "the token minted during the revocation lives on"
    denials = [r for r in auth.trail.read(decision="deny") if r["action"] == "token.renew"]
    assert denials
