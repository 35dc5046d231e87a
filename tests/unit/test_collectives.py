"""Guarded collectives: default deny, the whitelist and the group scope, over real gloo."""

import pytest
import torch
import torch.distributed as dist

from kuangchao.platform.security.tokens import Minter, Scope, generate_key
from kuangchao.workers import collectives as kc


@pytest.fixture
def gloo():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    denied: list[tuple[str, str]] = []
    kc.set_token(None, on_deny=lambda iface, group, why: denied.append((iface, why)))
    try:
        yield denied
    finally:
        kc.set_token(None)
        dist.destroy_process_group()


def token(interfaces=("all_reduce", "barrier"), groups=("world",), ttl_s=60.0, now=None):
    _, claims = Minter(generate_key()).mint("job-1/rank-0", "job-1", "trainer",
                                            Scope(groups=groups), interfaces, ttl_s, now=now)
    return claims


def test_nothing_is_allowed_without_a_token(gloo):
    with pytest.raises(PermissionError, match="missing"):
        kc.all_reduce(torch.ones(4))
    assert gloo == [("all_reduce", "missing: this process holds no capability token")]


def test_a_whitelisted_collective_in_scope_runs(gloo):
    kc.set_token(token())
    t = torch.ones(4)
    kc.all_reduce(t, group=kc.CommGroup(), op="sum")
    assert torch.equal(t, torch.ones(4)) and gloo == []


def test_a_collective_outside_the_whitelist_or_the_scope_is_denied(gloo):
    kc.set_token(token(interfaces=("all_reduce",)))
    with pytest.raises(PermissionError, match="may not call broadcast"):
        kc.broadcast(torch.ones(2), src=0)
    kc.set_token(token(groups=("dp",)))
    with pytest.raises(PermissionError, match="not a member of communication group 'world'"):
        kc.all_reduce(torch.ones(2))
    assert [i for i, _ in gloo] == ["broadcast", "all_reduce"]


def test_an_expired_token_allows_nothing(gloo):
    kc.set_token(token(ttl_s=1.0, now=0.0))
    with pytest.raises(PermissionError, match="expired"):
        kc.all_reduce(torch.ones(2))
