"""The spare pool's bookkeeping (platform/execution/spares.py): which nodes hold a spare
after each keep() and tick(), with Ray's actor calls replaced by a recording fake and
the node view and quarantine in an in-memory store."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.execution import spares
from kuangchao.platform.jobs.memory import MemoryStore
from kuangchao.platform.jobs.state import JobRecord
from kuangchao.platform.spec.jobspec import validate_spec
from tests.unit.test_controller import SETTINGS


class FakeActor:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.__ray_ready__ = self  # `.remote()` below gives the readiness ref

    def remote(self) -> str:
        return f"ready-{self.node_id}"


@pytest.fixture
def pool(monkeypatch):
    started: list[str] = []
    killed: list[str] = []

    class Remote:
        def options(self, scheduling_strategy, **_):
            self.node_id = scheduling_strategy.node_id
            return self

        def remote(self):
            started.append(self.node_id)
            return FakeActor(self.node_id)

    monkeypatch.setattr(spares.ray, "remote", lambda _cls: Remote())
    monkeypatch.setattr(spares, "NodeAffinitySchedulingStrategy",
                        lambda node_id, soft: SimpleNamespace(node_id=node_id))
    monkeypatch.setattr(spares, "kill_actor", lambda a: killed.append(a.node_id))
    store = MemoryStore(prefix=f"kc-test-{time.monotonic_ns()}:")
    p = spares.SparePool(SETTINGS)
    p._store = store
    p.started, p.killed = started, killed
    return p


def view(store, *nodes: NodeInfo) -> None:
    store.set_info("nodes", {"nodes": [n.to_json() for n in nodes]})


def node(name: str, **kw) -> NodeInfo:
    return NodeInfo(name=name, gpus=1, islands=((0,),), leaf="leaf-0", node_id=f"id-{name}",
                    pinned_gpus=True, gpu_type="h100-80gb", **kw)


def spec(standby: int = 1, dp: int = 2):
    return validate_spec({"task": {"name": "t"}, "parallel": {"data_parallel_size": dp,
                                                                "micro_batch_size": 1},
                          "fault_tolerance": {"spare_workers": True, "standby_spares": standby}})


def test_keep_starts_the_job_s_spares_and_a_standby_and_retires_what_is_left_out(pool):
    view(pool._store, node("a"), node("b"), node("c"), node("d", draining=True), node("e"))
    pool.keep({"id-a", "id-b"}, spec())
    assert set(pool.by_node) == {"id-a", "id-b", "id-c"} and pool.standby == {"id-c"}
    assert pool.standby_names() == ["c"] and pool.standby_nodes() == {"c": "id-c"}
    pool.keep({"id-a", "id-b"}, spec())  # again: nothing restarted
    assert sorted(pool.started) == ["id-a", "id-b", "id-c"] and pool.killed == []
    # b's replica moved to c (b lost, say), whose standby adopted it (taken off the pool):
    # c gets a spare of the job's own, and b's warm spare stands by in its place.
    pool.by_node.pop("id-c")
    pool.keep({"id-a", "id-c"}, spec())
    assert pool.standby == {"id-b"} and pool.killed == []
    assert set(pool.by_node) == {"id-a", "id-b", "id-c"} and pool.started.count("id-c") == 2
    # Then b drains: its spare goes, and the next eligible node stands by.
    view(pool._store, node("a"), node("b", draining=True), node("c"), node("e"))
    pool.keep({"id-a", "id-c"}, spec())
    assert pool.killed == ["id-b"] and pool.standby == {"id-e"}
    assert pool.standby_nodes() == {"e": "id-e"}  # where the job's keeper starts ahead
    pool.close()
    assert pool.standby_nodes() == {}


def test_no_standby_for_a_job_whose_survivors_do_not_keep_their_work(pool):
    view(pool._store, node("a"), node("b"), node("c"))
    hybrid = validate_spec({"task": {"name": "t"}, "parallel": {
        "data_parallel_size": 1, "tensor_parallel_size": 2, "micro_batch_size": 1},
        "model": {"n_heads": 4}, "fault_tolerance": {"spare_workers": True, "standby_spares": 1}})
    pool.keep({"id-a", "id-b"}, hybrid)
    assert pool.standby == set() and set(pool.by_node) == {"id-a", "id-b"}


def test_tick_gives_a_node_that_came_back_a_standby_and_a_quarantined_one_none(pool, monkeypatch):
    view(pool._store, node("a"), node("b"), node("c", alive=False))
    pool.keep({"id-a", "id-b"}, spec())
    assert pool.standby == set()
    pool.tick(spec())  # too soon after the last check: nothing read
    view(pool._store, node("a"), node("b"), node("c"))
    monkeypatch.setattr(spares, "STANDBY_CHECK_S", 0.0)
    pool.tick(spec())
    assert pool.standby == {"id-c"} and pool.started[-1] == "id-c"
    pool._store.quarantine_node("c", {"since": time.time(), "until": time.time() + 600,
                                      "failures": 3, "reason": "flaky"})
    pool.tick(spec())
    assert pool.standby == set() and pool.killed == ["id-c"]
    assert set(pool.by_node) == {"id-a", "id-b"}  # the job's own spares untouched


def test_redis_away_a_moment_leaves_the_standbys_as_they_are(pool, monkeypatch):
    view(pool._store, node("a"), node("b"), node("c"))
    pool.keep({"id-a", "id-b"}, spec())
    assert pool.standby == {"id-c"}

    def away(*_a, **_k):
        raise spares.redis.ConnectionError("Redis is restarting")  # the error the pool catches

    monkeypatch.setattr(pool._store, "info", away)
    pool.keep({"id-a", "id-b"}, spec())
    assert pool.standby == {"id-c"} and pool.killed == []
    assert pool.standby_names() == []  # no view to name it by: the relocation prefers nothing


def test_standby_names_missed_in_a_redis_blip_are_read_at_the_next_choice(pool, monkeypatch):
    view(pool._store, node("a"), node("b"), node("c"))
    real, calls = pool._store.info, []

    def blip(*a, **k):  # the choice's read goes through; the names' read, just after, does not
        calls.append(a)
        if len(calls) == 2:
            raise spares.redis.ConnectionError("Redis is restarting")
        return real(*a, **k)

    monkeypatch.setattr(pool._store, "info", blip)
    pool.keep({"id-a", "id-b"}, spec())
    assert pool.standby == {"id-c"} and pool.standby_nodes() == {}
    pool.keep({"id-a", "id-b"}, spec())  # the same choice: its names read again
    assert pool.standby_nodes() == {"c": "id-c"}


def test_the_job_record_shows_each_spare_warm_warming_or_failed(pool, monkeypatch):
    """`spares` on the job JSON: written when a spare's state changes, not at every poll,
    and cleared when the pool closes."""
    up: set[str] = set()
    failed: set[str] = set()

    def wait(refs, num_returns, timeout):
        assert timeout == 0  # asked without waiting, at each poll of the controller
        return [r for r in refs if r in up | failed], [r for r in refs if r not in up | failed]

    def get(ref, timeout=None):
        if ref in failed:
            raise spares.ray.exceptions.RayError("the spare's process did not start")

    monkeypatch.setattr(spares.ray, "wait", wait)
    monkeypatch.setattr(spares.ray, "get", get)
    store = pool._store
    store.create(JobRecord(id="job-1", name="t", spec={}))
    pool.job_id = "job-1"
    view(store, node("a"), node("b"), node("c"))
    pool.keep({"id-a", "id-b"}, spec())
    pool.tick(spec())
    assert store.get("job-1").spares == (
        {"node": "a", "state": "warming", "standby": False},
        {"node": "b", "state": "warming", "standby": False},
        {"node": "c", "state": "warming", "standby": True})
    up.update({"ready-id-a", "ready-id-b"})
    failed.add("ready-id-c")
    pool.tick(spec())
    assert [(e["node"], e["state"]) for e in store.get("job-1").spares] == [
        ("a", "warm"), ("b", "warm"), ("c", "failed")]
    version = store.get("job-1").version
    reads = []
    monkeypatch.setattr(store, "info", lambda name: reads.append(name))
    pool.tick(spec())  # nothing changed: neither the node view read nor the record written
    assert store.get("job-1").version == version and reads == []
    pool.close()
    assert store.get("job-1").spares == ()
