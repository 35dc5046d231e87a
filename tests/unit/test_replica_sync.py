"""The end-of-training replica check: which ranks must hold equal parameters.

`check_replicas_in_sync` gathers every rank's parameter digest; here the gather
is replaced by a list of digests so the rule itself is stepped directly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kuangchao.workers.errors import TrainingError
from kuangchao.workers.parallel.layout import Layout
from kuangchao.workers.trainer import loop


def run(monkeypatch, layout: Layout, fsdp: bool, digests: list[str]) -> str:
    rank = 0
    monkeypatch.setattr(loop, "params_digest", lambda model: digests[rank])
    monkeypatch.setattr(loop, "permit", lambda interface: None)
    monkeypatch.setattr(loop.dist, "all_gather_object", lambda out, obj: out.__setitem__(
        slice(None), digests))
    ctx = SimpleNamespace(world_size=layout.world_size, log=lambda *a, **k: None)
    engine = SimpleNamespace(holder=None, layout=layout, fsdp=fsdp)
    return loop.check_replicas_in_sync(engine, ctx)


def test_hsdp_ranks_holding_the_same_shard_must_agree(monkeypatch):
    hsdp = Layout(dp=4, shard_group=2)  # groups (0,1) and (2,3): shard 0 on 0 and 2
    run(monkeypatch, hsdp, True, ["a", "b", "a", "b"])
    with pytest.raises(TrainingError, match=r"ranks \[1, 3\]"):
        run(monkeypatch, hsdp, True, ["a", "b", "a", "c"])


def test_hsdp_digest_is_one_copy_of_every_shard(monkeypatch):
    hsdp = Layout(dp=4, shard_group=2)
    same_first_group = run(monkeypatch, hsdp, True, ["a", "b", "a", "b"])
    assert same_first_group == run(monkeypatch, Layout(dp=2), True, ["a", "b"])


def test_plain_fsdp_slices_are_not_compared_and_ddp_replicas_are(monkeypatch):
    run(monkeypatch, Layout(dp=4), True, ["a", "b", "c", "d"])
    with pytest.raises(TrainingError, match="diverged"):
        run(monkeypatch, Layout(dp=2), False, ["a", "b"])


def test_expert_parallel_ranks_holding_the_same_experts_must_agree(monkeypatch):
    ep = Layout(dp=4, ep=2)  # experts split over (0,1) and (2,3): rank 0's also on rank 2
    digest = run(monkeypatch, ep, False, ["a", "b", "a", "b"])
    assert digest == run(monkeypatch, Layout(dp=2, ep=2), False, ["a", "b"])  # one copy of each
    with pytest.raises(TrainingError, match=r"ranks \[1, 3\]"):
        run(monkeypatch, ep, False, ["a", "b", "a", "c"])
