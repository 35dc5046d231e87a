"""Peer-memory checkpoints, the rank's side (workers/checkpoint/peer_memory.py) against
keepers in this process: the keeper's own class (platform/execution/keeper.py) with
real signed tokens, called the way RayKeepers calls the actors, without Ray."""

from __future__ import annotations

import hashlib
import random
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kuangchao.platform.errors import CopyRefused, TokenError
from kuangchao.platform.execution.keeper import Keeper
from kuangchao.platform.protocol.memory_copies import KeeperPlan, keeper_name
from kuangchao.platform.security.tokens import Minter, Scope, generate_key, public_pem
from kuangchao.platform.spec.checkpoint import InMemorySection
from kuangchao.platform.spec.jobspec import validate_spec
from kuangchao.workers.checkpoint import peer_memory
from kuangchao.workers.checkpoint.peer_memory import PeerMemory
from kuangchao.workers.trainer.checkpoints import push_to_peers
from kuangchao.workers.trainer.numerics import GradNormGuard
from kuangchao.workers.trainer.resume import Position, rank_state, restore_latest

JOB = "job-pm"
KEY = generate_key()
MINTER = Minter(KEY)
PEM = public_pem(KEY).decode()
SECTION = InMemorySection(interval_steps=1, replicas=1, max_mb_per_rank=16)


def token(job: str = JOB, role: str = "trainer", ifaces=("checkpoint_read", "checkpoint_write"),
          ttl_s: float = 600, now: float | None = None) -> str:
    return MINTER.mint(f"{job}/rank-0", job, role, Scope(), ifaces, ttl_s, now=now)[0]


class LocalKeepers:
    """RayKeepers' calls on in-process keepers; a node taken out answers LookupError."""

    def __init__(self, nodes, max_bytes: int = SECTION.max_bytes_per_rank) -> None:
        self.by_node = {n: Keeper(JOB, n, PEM, max_bytes) for n in nodes}
        self.gate: threading.Event | None = None

    def _call(self, node, fn):
        keeper = self.by_node.get(node)
        if keeper is None:
            return LookupError(f"the job has no keeper on {node}")
        try:
            return fn(keeper)
        except (TokenError, CopyRefused) as exc:
            return exc

    def put(self, nodes, tok, meta, data):
        if self.gate is not None:
            self.gate.wait(10)
        return {n: self._call(n, lambda k: k.put(tok, meta, data)) for n in nodes}

    def listing(self, nodes, tok, rank):
        return {n: self._call(n, lambda k: k.listing(tok, rank)) for n in nodes}

    def get(self, node, tok, rank, step):
        answer = self._call(node, lambda k: k.get(tok, rank, step))
        if isinstance(answer, BaseException):
            raise answer
        return answer


def plan(nodes=("a", "b"), ranks=None) -> KeeperPlan:
    node_of = ranks if ranks is not None else dict(enumerate(nodes))  # rank 1's node: a peer
    return KeeperPlan({n: keeper_name(JOB, n) for n in nodes}, node_of)


class Lines(list):
    def __call__(self, message, level="INFO", **_):
        self.append((level, message))

    def text(self) -> str:
        return "\n".join(m for _, m in self)


def memory(keepers, section=SECTION, tok=None, world_size=1, spec_hash="h1", nodes=("a", "b")):
    log = Lines()
    pm = PeerMemory(plan(nodes), 0, world_size, spec_hash, section, lambda: tok or token(), log,
                    keepers=keepers)
    return pm, log


def trained(seed: int = 0, steps: int = 3):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 8)).pow(2).mean().backward()
        opt.step()
    return model, opt


def digest(model, opt) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode() + t.numpy().tobytes())
    for pid, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"{pid}{k}".encode() + v.numpy().tobytes())
    return h.hexdigest()


def push(pm, step, model, opt, skipped=()):
    guard = GradNormGuard(10.0, 5)
    assert pm.push(step, model, opt, rank_state(step, list(skipped), guard))
    assert pm.wait(10)


def test_a_pushed_copy_restores_a_fresh_model_and_optimizer_bit_identically():
    keepers = LocalKeepers(["a", "b"])
    pm, log = memory(keepers)
    model, opt = trained()
    push(pm, 3, model, opt, skipped=[7])
    assert pm.pushed == 1 and pm.last["nodes"] == ["a", "b"] and pm.last_blocked_s < 5
    assert {n: k.store.steps(0) for n, k in keepers.by_node.items()} == {"a": {3}, "b": {3}}
    want = digest(model, opt)
    fresh, fresh_opt = trained(seed=1, steps=0)  # another init, no optimizer state yet
    got = peer_memory.restore(pm, 2, fresh, fresh_opt)
    assert got is not None and got["step"] == 3 and got["node"] == "a"
    assert got["rank_state"]["skipped_batches"] == [7]
    assert digest(fresh, fresh_opt) == want
    # the optimizer goes on exactly as the original would
    for m, o in ((model, opt), (fresh, fresh_opt)):
        torch.manual_seed(5)
        o.zero_grad()
        m(torch.randn(5, 8)).sum().backward()
        o.step()
    assert digest(fresh, fresh_opt) == digest(model, opt)


def test_the_copy_is_taken_when_pushed_not_when_sent():
    keepers = LocalKeepers(["a", "b"])
    keepers.gate = threading.Event()
    pm, _ = memory(keepers)
    model, opt = trained()
    want = digest(model, opt)
    guard = GradNormGuard(10.0, 5)
    assert pm.push(1, model, opt, rank_state(1, [], guard))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the next step changes the live state in place
    keepers.gate.set()
    assert pm.wait(10)
    fresh, fresh_opt = trained(seed=2, steps=0)
    assert peer_memory.restore(pm, None, fresh, fresh_opt)["step"] == 1
    assert digest(fresh, fresh_opt) == want


def test_a_push_still_running_when_the_next_is_due_is_skipped_and_counted():
    keepers = LocalKeepers(["a", "b"])
    keepers.gate = threading.Event()
    pm, log = memory(keepers)
    model, opt = trained()
    guard = GradNormGuard(10.0, 5)
    assert pm.push(1, model, opt, rank_state(1, [], guard))
    assert not pm.push(2, model, opt, rank_state(2, [], guard))
    assert not pm.push(3, model, opt, rank_state(3, [], guard))
    assert pm.skipped == 2 and "step 1 is still being pushed" in log.text()
    keepers.gate.set()
    assert pm.wait(10) and pm.pushed == 1
    assert keepers.by_node["a"].store.steps(0) == {1}


def test_every_rank_skips_a_copy_while_any_rank_still_pushes_so_all_hold_the_same_steps(tmp_path):
    ctx = context({"interval_steps": 1, "max_mb_per_rank": 8}, plan().to_json(), tmp_path)
    keepers = LocalKeepers(["a", "b"])
    ctx.peer_memory = PeerMemory(plan(), 0, 1, ctx.spec.spec_hash(), ctx.spec.checkpoint.in_memory,
                                 token, ctx.log, keepers=keepers)
    model, opt = trained()
    guard = GradNormGuard(10.0, 5)
    push_to_peers(ctx, 1, model, opt, Position(1, []), guard)
    assert ctx.peer_memory.wait(10)
    ctx.others_busy = True  # this rank is free, another is still pushing: nobody pushes
    push_to_peers(ctx, 2, model, opt, Position(2, []), guard)
    ctx.others_busy = False
    push_to_peers(ctx, 3, model, opt, Position(3, []), guard)
    assert ctx.peer_memory.wait(10)
    assert keepers.by_node["a"].store.steps(0) == {1, 3}
    assert ctx.peer_memory.skipped == 1
    assert "another rank's copy is still being pushed" in ctx.log.text()


def test_a_copy_over_the_bound_is_never_sent_and_the_rank_says_so_once():
    keepers = LocalKeepers(["a", "b"])
    pm, log = memory(keepers, section=InMemorySection(interval_steps=1, max_mb_per_rank=1))
    big = torch.nn.Linear(512, 512)  # 1 MiB of weights, 3 with AdamW's moments
    opt = torch.optim.AdamW(big.parameters())
    big(torch.randn(2, 512)).sum().backward()
    opt.step()
    push(pm, 1, big, opt)
    assert pm.disabled is not None and "checkpoint.in_memory.max_mb_per_rank (1.0 MB)" in pm.disabled
    assert "disk checkpoints" in pm.disabled
    assert all(k.store.list() == [] for k in keepers.by_node.values())
    assert not pm.push(2, big, opt, rank_state(2, [], GradNormGuard(10.0, 5)))
    assert sum("max_mb_per_rank" in m for _, m in log) == 1


def test_a_keeper_with_a_smaller_bound_refuses_and_the_rank_stops_pushing():
    keepers = LocalKeepers(["a", "b"], max_bytes=1000)
    pm, _ = memory(keepers)
    model, opt = trained()
    push(pm, 1, model, opt)
    assert pm.disabled is not None and "too_large" in pm.disabled


def test_a_corrupted_copy_is_ignored_with_its_reason_and_another_keepers_used():
    keepers = LocalKeepers(["a", "b"])
    pm, log = memory(keepers)
    model, opt = trained()
    push(pm, 4, model, opt)
    store = keepers.by_node["a"].store
    meta, data = store._copies[0, 4]
    store._copies[0, 4] = (meta, bytes([data[0] ^ 0xFF]) + data[1:])  # a bit flipped in memory
    fresh, fresh_opt = trained(seed=3, steps=0)
    got = peer_memory.restore(pm, None, fresh, fresh_opt)
    assert got["node"] == "b" and digest(fresh, fresh_opt) == digest(model, opt)
    assert "CRC-32" in log.text() and "on a" in log.text()
    # every copy corrupted: nothing is loaded, and the ranks go to disk
    meta, data = keepers.by_node["b"].store._copies[0, 4]
    keepers.by_node["b"].store._copies[0, 4] = (meta, data[:-1] + bytes([data[-1] ^ 1]))
    before = digest(fresh, fresh_opt)
    assert peer_memory.restore(pm, None, fresh, fresh_opt) is None
    assert digest(fresh, fresh_opt) == before


def test_a_copy_of_another_layout_or_model_is_not_restored():
    keepers = LocalKeepers(["a", "b"])
    pm, log = memory(keepers, world_size=2)
    model, opt = trained()
    push(pm, 5, model, opt)
    other, _ = memory(keepers, world_size=1)
    assert other.available() == {}
    assert "written by 2 ranks" in other._log.text()
    # same layout, another model: the copy does not fit the shards
    pm1, log1 = memory(LocalKeepers(["a", "b"]))
    push(pm1, 5, model, opt)
    wider = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    wider_opt = torch.optim.AdamW(wider.parameters())
    assert peer_memory.restore(pm1, None, wider, wider_opt) is None
    assert "this rank holds (32, 8)" in log1.text()


def test_a_copy_older_than_the_disk_checkpoint_is_not_used():
    keepers = LocalKeepers(["a", "b"])
    pm, log = memory(keepers)
    model, opt = trained()
    push(pm, 6, model, opt)
    fresh, fresh_opt = trained(seed=4, steps=0)
    assert peer_memory.restore(pm, 7, fresh, fresh_opt) is None
    assert "restoring from disk" in log.text()
    assert peer_memory.restore(pm, 6, fresh, fresh_opt)["step"] == 6


def test_a_lost_node_leaves_the_copy_on_its_peer():
    keepers = LocalKeepers(["a", "b"])
    pm, log = memory(keepers)
    model, opt = trained()
    push(pm, 2, model, opt)
    del keepers.by_node["a"]  # node a is gone, and its keeper with it
    assert pm.available() == {2: ["b"]}
    fresh, fresh_opt = trained(seed=5, steps=0)
    assert peer_memory.restore(pm, None, fresh, fresh_opt)["node"] == "b"
    assert digest(fresh, fresh_opt) == digest(model, opt)
    assert "could not list" in log.text()


def test_a_rank_on_a_node_without_a_keeper_pushes_to_its_peers():
    keepers = LocalKeepers(["b"])
    pm = PeerMemory(KeeperPlan({"b": keeper_name(JOB, "b")}, {0: "a", 1: "b"}), 0, 2, "h",
                    SECTION, token, Lines(), keepers=keepers)
    assert pm.targets() == ["b"]
    alone = PeerMemory(KeeperPlan({"a": "x"}, {0: "a", 1: "a"}), 1, 2, "h", SECTION, token,
                       log := Lines(), keepers=keepers)
    assert alone.targets() == ["a"] and "one node" in log.text()


def test_a_survivor_copies_by_the_new_generations_plan_after_a_replica_moved():
    """Rank 1 of [a, b] is rank 0 of [b, c] once a's replica moved to c: its copies go to
    its own node and to c's keeper, no longer to a's (lost)."""
    keepers = LocalKeepers(["a", "b", "c"])
    names = {n: keeper_name(JOB, n) for n in "abc"}
    pm = PeerMemory(KeeperPlan({"a": names["a"], "b": names["b"]}, {0: "a", 1: "b"}), 1, 2, "h",
                    SECTION, token, Lines(), keepers=keepers)
    assert pm.targets() == ["b", "a"]
    pm.regroup(0, 2)
    pm.replan(KeeperPlan(names, {0: "b", 1: "c"}))
    assert pm.targets() == ["b", "c"]


# -- the keeper's token check -------------------------------------------------------------


def test_the_keeper_admits_only_its_own_jobs_valid_trainer_tokens():
    keeper = Keeper(JOB, "a", PEM, 1024)
    data = b"state"
    from kuangchao.platform.protocol.memory_copies import CopyLayout, CopyMeta, checksum

    meta = CopyMeta(0, 1, len(data), checksum(data), CopyLayout(1, "h")).to_json()
    assert keeper.put(token(), meta, data)["bytes_held"] == len(data)
    refused = {
        "another job": (token(job="other-job"), "denied", "job other-job"),
        "no token": (None, "missing", ""),
        "expired": (token(ttl_s=60, now=time.time() - 120), "expired", ""),
        "another role": (token(role="monitor", ifaces=("heartbeat",)), "denied", "monitor token"),
        "no write right": (token(ifaces=("checkpoint_read",)), "denied", "checkpoint_write"),
        "another key": (Minter(generate_key()).mint("x", JOB, "trainer", Scope(),
                                                    ("checkpoint_write",), 60)[0], "tampered", ""),
    }
    for case, (tok, reason, words) in refused.items():
        with pytest.raises(TokenError) as info:
            keeper.put(tok, meta, data)
        assert info.value.reason == reason, case
        assert words in str(info.value), case
    with pytest.raises(TokenError):
        keeper.get(token(job="other-job"), 0, 1)
    with pytest.raises(TokenError):
        keeper.listing(token(ifaces=("checkpoint_write",)), 0)
    assert keeper.get(token(), 0, 1)["data"] == data
    assert keeper.stats()["refused"] == len(refused) + 2
    assert keeper.stats()["bytes"] == len(data) and keeper.drop(token()) == len(data)


# -- the trainer's hooks --------------------------------------------------------------------


def context(in_memory, keepers, tmp_path):
    spec = validate_spec({"checkpoint": {"path": str(tmp_path),
                                         **({"in_memory": in_memory} if in_memory else {})}})
    ckpt = SimpleNamespace(list=lambda: [], wait=lambda: None, holder=None)
    # One rank here: whether any rank flags is this rank's own flag (`others_busy` stands in
    # for another rank whose push is still in flight).
    ctx = SimpleNamespace(spec=spec, keepers=keepers, peer_memory=None, rank=0, world_size=1,
                          checkpoint=ckpt, log=Lines(), node="a", others_busy=False)
    ctx.any_rank = lambda flag, what: flag or ctx.others_busy
    return ctx


@pytest.mark.parametrize("in_memory, keepers", [
    (None, plan().to_json()),  # the spec asks for none
    ({"interval_steps": 1, "max_mb_per_rank": 8}, None),  # no keepers were named
])
def test_the_hooks_are_inert_without_in_memory_or_keepers(tmp_path, in_memory, keepers):
    ctx = context(in_memory, keepers, tmp_path)
    model, opt = trained()
    assert peer_memory.of(ctx) is None
    push_to_peers(ctx, 1, model, opt, Position(1, []), GradNormGuard(10.0, 5))
    assert ctx.peer_memory is None
    assert restore_latest(ctx, model, opt, GradNormGuard(10.0, 5)) is None


def test_the_hooks_push_on_the_interval_and_restore_position_and_rng(tmp_path):
    ctx = context({"interval_steps": 2, "max_mb_per_rank": 8}, plan().to_json(), tmp_path)
    keepers = LocalKeepers(["a", "b"])
    ctx.peer_memory = PeerMemory(plan(), 0, 1, ctx.spec.spec_hash(), ctx.spec.checkpoint.in_memory,
                                 token, ctx.log, keepers=keepers)
    assert peer_memory.of(ctx) is ctx.peer_memory
    model, opt = trained()
    guard = GradNormGuard(10.0, 5)
    for step in (1, 2, 3):
        push_to_peers(ctx, step, model, opt, Position(step, [4]), guard)
        ctx.peer_memory.wait(10)
    assert keepers.by_node["a"].store.steps(0) == {2}  # every second step only
    torch.manual_seed(11)
    np.random.seed(11)
    random.seed(11)
    want = (torch.rand(1).item(), np.random.rand(), random.random())
    torch.manual_seed(11)
    np.random.seed(11)
    random.seed(11)
    push_to_peers(ctx, 4, model, opt, Position(4, [4]), guard)  # the RNG as of now
    ctx.peer_memory.wait(10)
    torch.manual_seed(0)
    ctx.checkpoint.last_restored_step = ctx.checkpoint.last_load_s = ctx.checkpoint.last_load_end = None
    fresh, fresh_opt = trained(seed=6, steps=0)
    pos = restore_latest(ctx, fresh, fresh_opt, GradNormGuard(10.0, 5))
    assert (pos.step, pos.skipped) == (4, [4])
    assert (torch.rand(1).item(), np.random.rand(), random.random()) == want
    assert digest(fresh, fresh_opt) == digest(model, opt)
    assert ctx.checkpoint.last_restored_step == 4 and ctx.checkpoint.last_load_s is not None
    assert "from peer memory (the keeper on a)" in ctx.log.text()
