"""Peer-memory checkpoints on real Ray: keepers (platform/execution/keeper.py) on two
nodes, a rank's state pushed from a process on one (workers/checkpoint/peer_memory.py),
that node's raylet SIGKILLed, and the state restored bit for bit from the other
node's keeper. The keepers check real signed tokens and the bound.

A Ray cluster of the module's own (`ray.cluster_utils.Cluster`: a head and two
nodes, A and B, each with a custom resource to pin work there), with a fast GCS
health check so that the lost node is declared dead within seconds. It starts no
kuangchao stack; being a Ray cluster of its own, it runs in the first tier, before
the shared stack's driver connects (tests/conftest.py). About 30 s on
2 cores, most of it the cluster coming up.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.integration.conftest import raylet_of, wait_for
from tests.unit.test_peer_memory import digest

pytestmark = [pytest.mark.integration, pytest.mark.own_stack]

JOB = "job-peer-mem"
BOUND_MB = 2
HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
          "health_check_timeout_ms": 500, "health_check_failure_threshold": 4}


@dataclass
class Bed:
    ray: Any
    a: str  # node ids
    b: str
    minter: Any
    pem: str
    keepers: dict[str, str]  # node -> keeper name

    def token(self, job: str = JOB, **kw: Any) -> str:
        from kuangchao.platform.security.tokens import Scope

        return self.minter.mint(f"{job}/rank-0", job, "trainer", Scope(),
                                ("checkpoint_read", "checkpoint_write"), kw.get("ttl_s", 600),
                                now=kw.get("now"))[0]

    def keeper(self, node: str) -> Any:
        return self.ray.get_actor(self.keepers[node], namespace="kuangchao")


@pytest.fixture(scope="module")
def bed() -> Iterator[Bed]:
    import ray
    from ray.cluster_utils import Cluster

    from kuangchao.platform.execution.keeper import start_keepers
    from kuangchao.platform.security.tokens import Minter, generate_key, public_pem

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                      "_system_config": HEALTH})
    try:
        a = c.add_node(num_cpus=1, resources={"node_a": 10}).node_id
        b = c.add_node(num_cpus=1, resources={"node_b": 10}).node_id
        ray.init(address=c.address, log_to_driver=False)
        c.wait_for_nodes()
        key = generate_key()
        pem = public_pem(key).decode()
        keepers = start_keepers(JOB, {"a": a, "b": b}, pem, BOUND_MB * 1024 * 1024)
        assert sorted(keepers) == ["a", "b"], keepers
        yield Bed(ray, a, b, Minter(key), pem, keepers)
    finally:
        ray.shutdown()
        c.shutdown()


def _cause(call) -> BaseException:
    """The keeper's own exception behind Ray's RayTaskError."""
    with pytest.raises(Exception) as info:
        call()
    return getattr(info.value, "cause", None) or info.value


def _meta(rank: int, step: int, data: bytes, crc: int | None = None) -> dict[str, Any]:
    from kuangchao.platform.protocol.memory_copies import CopyLayout, CopyMeta, checksum

    return CopyMeta(rank, step, len(data), checksum(data) if crc is None else crc,
                    CopyLayout(1, "h")).to_json()


def test_keepers_refuse_another_jobs_token_and_a_missing_or_expired_one(bed: Bed) -> None:
    from kuangchao.platform.errors import TokenError

    ray, b = bed.ray, bed.keeper("b")
    data = b"rank state"
    for tok, reason in ((bed.token(job="another-job"), "denied"), (None, "missing"),
                        (bed.token(ttl_s=60, now=time.time() - 120), "expired")):
        exc = _cause(lambda tok=tok: ray.get(b.put.remote(tok, _meta(9, 1, data), data), timeout=30))
        assert isinstance(exc, TokenError) and exc.reason == reason, exc
    exc = _cause(lambda: ray.get(b.get.remote(bed.token(job="another-job"), 9, 1), timeout=30))
    assert isinstance(exc, TokenError) and "another-job" in str(exc)
    assert ray.get(b.listing.remote(bed.token(), 9), timeout=30) == []
    assert ray.get(b.stats.remote(), timeout=30)["refused"] == 4


def test_keepers_enforce_the_bound_and_refuse_a_corrupted_copy(bed: Bed) -> None:
    from kuangchao.platform.errors import CopyRefused
    from kuangchao.platform.protocol.memory_copies import KeeperPlan
    from kuangchao.platform.spec.checkpoint import InMemorySection
    from kuangchao.workers.checkpoint.peer_memory import PeerMemory

    ray, b, tok = bed.ray, bed.keeper("b"), bed.token()
    big = b"x" * (BOUND_MB * 1024 * 1024 + 1)
    exc = _cause(lambda: ray.get(b.put.remote(tok, _meta(8, 1, big), big), timeout=60))
    assert isinstance(exc, CopyRefused) and exc.reason == "too_large"
    assert "max_mb_per_rank" in str(exc)
    data = b"a copy"
    exc = _cause(lambda: ray.get(b.put.remote(tok, _meta(8, 1, data, crc=12345), data), timeout=30))
    assert isinstance(exc, CopyRefused) and exc.reason == "checksum"
    assert ray.get(b.stats.remote(), timeout=30)["copies"] == 0
    # Bytes that pass their checksum but are no state: fetched, refused, nothing loaded.
    ray.get(b.put.remote(tok, _meta(8, 2, data), data), timeout=30)
    lines: list[str] = []
    pm = PeerMemory(KeeperPlan(bed.keepers, {8: "b"}), 8, 1, "h",
                    InMemorySection(interval_steps=1, max_mb_per_rank=BOUND_MB), lambda: tok,
                    lambda m, level="INFO": lines.append(m))
    assert pm.available() == {2: ["b"]}
    assert pm.fetch(2, ["b"]) is None and "ignoring rank 8's copy of step 2 on b" in "\n".join(lines)
    assert ray.get(b.drop.remote(tok, 8), timeout=30) == len(data)


def _pusher(ray: Any) -> Any:
    """A task that trains a small model a few steps and pushes its state as rank 0."""

    @ray.remote(num_cpus=0, resources={"node_a": 1})
    def push(plan_doc: dict[str, Any], tok: str) -> dict[str, Any]:
        import hashlib

        import torch

        from kuangchao.platform.protocol.memory_copies import KeeperPlan
        from kuangchao.platform.spec.checkpoint import InMemorySection
        from kuangchao.workers.checkpoint.peer_memory import PeerMemory

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(16, 32)).pow(2).mean().backward()
            opt.step()
        said: list[str] = []
        pm = PeerMemory(KeeperPlan.from_json(plan_doc), 0, 1, "h",
                        InMemorySection(interval_steps=1, max_mb_per_rank=BOUND_MB), lambda: tok,
                        lambda m, level="INFO": said.append(m))
        rank_state = {"rng": {"torch": torch.get_rng_state()}, "step": 4, "skipped_batches": [],
                      "grad_norms": []}
        assert pm.push(4, model, opt, rank_state) and pm.wait(60)
        h = hashlib.sha256()
        for name, t in sorted(model.state_dict().items()):
            h.update(name.encode() + t.numpy().tobytes())
        for pid, st in sorted(opt.state_dict()["state"].items()):
            for k, v in sorted(st.items()):
                h.update(f"{pid}{k}".encode() + v.numpy().tobytes())
        return {"digest": h.hexdigest(), "last": pm.last, "said": said, "pushed": pm.pushed}

    return push


def _keeper_pid(node_id: str) -> int:
    """The keeper's worker process on a node: a child of its raylet titled `ray::Keeper`."""
    from kuangchao.platform.runtime import procs

    raylet = raylet_of(node_id)
    found = []
    for pid in procs._all_pids():
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == raylet and procs._cmdline(pid).startswith("ray::Keeper"):
            found.append(pid)
    assert len(found) == 1, f"expected one keeper under raylet {raylet}, found {found}"
    return found[0]


def test_a_keeper_that_stops_answering_holds_no_copy_to_the_others_up(bed: Bed) -> None:
    """A raylet killed takes seconds to fail its keeper's calls; a stopped keeper never
    answers. Either way the copy to the other keeper is done within the straggler
    grace, the next copy goes to it alone, and the one left behind lands in order
    once the keeper runs again."""
    from kuangchao.platform.protocol.memory_copies import KeeperPlan
    from kuangchao.workers.checkpoint.ray_keepers import PUT_TIMEOUT_S, RayKeepers

    tok, data = bed.token(), os.urandom(4096)
    keepers = RayKeepers(KeeperPlan(bed.keepers, {0: "a", 1: "b"}))
    first = keepers.put(["a", "b"], tok, _meta(5, 1, data), data)
    assert not [a for a in first.values() if isinstance(a, BaseException)], first
    pid = _keeper_pid(bed.b)
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        second = keepers.put(["a", "b"], tok, _meta(5, 2, data), data)
        took = time.monotonic() - t0
        assert second["a"]["step"] == 2 and isinstance(second["b"], TimeoutError), second
        # Done once A took it and B had STRAGGLER_S more: not after the call's own timeout.
        assert took < PUT_TIMEOUT_S / 4, f"the push waited {took:.1f}s for a stopped keeper"
        third = keepers.put(["a", "b"], tok, _meta(5, 3, data), data)
        assert third["a"]["step"] == 3 and "still taking an earlier copy" in str(third["b"])
    finally:
        os.kill(pid, signal.SIGCONT)
    # The copy left behind lands; the keeper takes copies again, newest last.
    wait_for(lambda: not keepers._still_taking("b"), 60, "B's keeper to take the copy left behind")
    fourth = keepers.put(["a", "b"], tok, _meta(5, 4, data), data)
    assert fourth["b"]["step"] == 4, fourth
    # B took 1, then (late) 2, never 3, then 4, and keeps the two newest. Had 2 landed
    # after 4, it would have dropped 4 (a put drops the rank's newer copies).
    listed = bed.ray.get(bed.keeper("b").listing.remote(tok, 5), timeout=30)
    assert [m["step"] for m in listed] == [2, 4], listed
    for node in ("a", "b"):  # leave no copies of this rank to the tests after
        bed.ray.get(bed.keeper(node).drop.remote(tok, 5), timeout=30)


def test_a_copy_outlives_its_node_and_restores_bit_identically(bed: Bed) -> None:

    import torch

    from kuangchao.platform.execution.keeper import job_keepers, keeper_stats, kill_keepers
    from kuangchao.platform.protocol.memory_copies import KeeperPlan
    from kuangchao.platform.spec.checkpoint import InMemorySection
    from kuangchao.workers.checkpoint import peer_memory

    ray, tok = bed.ray, bed.token()
    plan = KeeperPlan(bed.keepers, {0: "a", 1: "b"})  # rank 0 on A; its peer is B
    pushed = ray.get(_pusher(ray).remote(plan.to_json(), tok), timeout=120)
    assert pushed["pushed"] == 1 and pushed["last"]["nodes"] == ["a", "b"], pushed
    held = keeper_stats(bed.keepers)
    assert held["a"]["bytes"] == held["b"]["bytes"] == pushed["last"]["bytes"] > 0

    os.kill(raylet_of(bed.a), signal.SIGKILL)  # node A is lost, and its keeper with it
    wait_for(lambda: not next(n["Alive"] for n in ray.nodes() if n["NodeID"] == bed.a), 30,
             "the GCS to declare node A dead", interval=0.2)
    wait_for(lambda: bed.keepers["a"] not in job_keepers(JOB), 30, "A's keeper to be gone")

    lines: list[str] = []
    pm = peer_memory.PeerMemory(plan, 0, 1, "h", InMemorySection(interval_steps=1,
                                                                 max_mb_per_rank=BOUND_MB),
                                lambda: tok, lambda m, level="INFO": lines.append(m))
    assert pm.available() == {4: ["b"]}, lines
    torch.manual_seed(1)  # another init, and an optimizer without state
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    got = peer_memory.restore(pm, 3, model, opt)
    assert got is not None and got["step"] == 4 and got["node"] == "b", lines
    assert digest(model, opt) == pushed["digest"]
    # A newer disk checkpoint wins over the copy.
    assert peer_memory.restore(pm, 5, model, opt) is None

    assert kill_keepers(JOB) == 1
    wait_for(lambda: job_keepers(JOB) == [], 30, "the job's keepers to be gone")
