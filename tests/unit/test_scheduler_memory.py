"""The scheduler's cycle on the in-memory store: no Redis, same contract
(tests/store_contract.py holds both stores to it)."""

from __future__ import annotations

from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.jobs.memory import MemoryStore
from kuangchao.platform.jobs.state import JobRecord, JobState
from kuangchao.platform.observability import metrics
from kuangchao.platform.scheduling.scheduler import Scheduler


def nodes() -> tuple[NodeInfo, ...]:
    return tuple(NodeInfo(name=f"n{i}", gpus=4, islands=((0, 1, 2, 3),), leaf="leaf-0",
                          node_id=f"id{i}") for i in range(2))


def job(jid: str, gpus: int, created: float) -> JobRecord:
    return JobRecord(id=jid, name=jid, spec={"parallel": {"data_parallel_size": gpus}},
                     created_at=created, gpus=gpus, world_size=gpus)


def test_a_cycle_admits_what_fits_cancels_on_request_and_records_its_time():
    store, launched = MemoryStore(), []
    store.create(job("a", 4, 1.0))
    store.create(job("b", 4, 2.0))
    store.create(job("c", 4, 3.0))
    store.request_cancel("c")
    Scheduler(store, nodes, launched.append).step()
    states = {j.id: j.state for j in store.list()}
    assert states == {"a": JobState.PLACING, "b": JobState.PLACING, "c": JobState.CANCELLED}
    assert launched == ["a", "b"] and len(store.get("a").placement) == 4
    assert [j.id for j in store.list_active()] == ["a", "b"]
    assert any(f.startswith(f'["{metrics.SCHEDULER_CYCLE.name}_count"') for f in store.metric_fields())


def test_a_job_that_does_not_fit_waits_with_its_reason():
    store = MemoryStore()
    store.create(job("big", 16, 1.0))
    Scheduler(store, nodes, lambda _: None).step()
    got = store.get("big")
    assert got.state is JobState.QUEUED and got.waiting_for
