"""The scheduler itself, stepped one cycle at a time on an in-memory store."""

import time

import pytest

from kuangchao.platform.control import operations
from kuangchao.platform.jobs.memory import MemoryStore
from kuangchao.platform.jobs.state import JobRecord, JobState, finish, start
from kuangchao.platform.scheduling.plugins.decisions import Admit, Preempt, Resize, Wait
from kuangchao.platform.scheduling.scheduler import Scheduler
from kuangchao.platform.spec.jobspec import validate_spec
from kuangchao.platform.spec.queues import Queue, QueueTable

from .test_gang_policy import nodes


@pytest.fixture(autouse=True)
def _kc_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KC_HOME", str(tmp_path))


class Rig:
    """A scheduler over a MemoryStore and a fixed node view; `launched` lists its launches."""

    def __init__(self, cluster=None, queues: QueueTable | None = None) -> None:
        self.store = MemoryStore()
        if queues is not None:
            self.store.set_info("queues", queues.to_json())
        self.cluster = cluster or nodes()
        self.launched: list[str] = []
        self.scheduler = Scheduler(self.store, lambda: self.cluster, self.launched.append)

    def submit(self, name: str, gpus: int = 1, priority: int = 50, queue: str = "default",
               elastic: tuple[int, int] | None = None) -> str:
        doc = {"task": {"name": name, "priority": priority, "queue": queue},
               "parallel": {"data_parallel_size": gpus, "micro_batch_size": 1,
                            "gradient_accumulation_steps": 8 // gpus if 8 % gpus == 0 else 1}}
        if elastic:
            doc["elastic"] = {"min_replicas": elastic[0], "max_replicas": elastic[1]}
        return operations.submit(self.store, validate_spec(doc)).id

    def run(self, job_id: str) -> JobRecord:
        """The controller's part: the admitted job starts running."""
        self.store.update(job_id, lambda j: start(j, "running"))
        return self.store.get(job_id)

    def step(self) -> dict[str, list]:
        out: dict[str, list] = {}
        for d in self.scheduler.step():
            out.setdefault(d.job_id, []).append(d)
        return out

    def job(self, job_id: str) -> JobRecord:
        return self.store.get(job_id)


def test_scheduler_admits_a_job_that_fits_and_launches_its_controller():
    rig = Rig()
    jid = rig.submit("fits", gpus=4)
    d = rig.step()
    assert isinstance(d[jid][0], Admit)
    job = rig.job(jid)
    assert job.state is JobState.PLACING and len(job.placement) == 4 and job.replicas == 4
    assert rig.launched == [jid]


def test_scheduler_cancels_a_queued_job_on_request_before_the_policy_runs():
    rig = Rig()
    jid = rig.submit("unwanted", gpus=2)
    rig.store.request_cancel(jid)
    assert rig.step() == {}
    assert rig.job(jid).state is JobState.CANCELLED and rig.launched == []


def test_scheduler_records_why_a_job_waits_once_not_every_cycle():
    rig = Rig(cluster=nodes(n=1))
    jid = rig.submit("too-big", gpus=16)
    for _ in range(3):
        assert [type(x) for x in rig.step()[jid]] == [Wait]
    assert rig.job(jid).waiting_for == "needs 16 GPUs, the cluster has 8"
    waits = [e for e in rig.store.events(jid) if e.get("type") == "waiting"]
    assert len(waits) == 1


def test_scheduler_marks_and_signals_the_victim_of_a_higher_priority_job():
    rig = Rig(cluster=nodes(n=1))
    low = rig.submit("low", gpus=8, priority=10)
    rig.step()
    rig.run(low)
    urgent = rig.submit("urgent", gpus=8, priority=100)
    d = rig.step()
    assert d[low] == [Preempt(low, urgent, f"preempted for higher-priority job {urgent}")]
    assert rig.job(low).preempting_for == urgent and rig.store.preempt_requested(low)
    # The next cycle waits for the checkpoint instead of choosing another victim.
    assert rig.step() == {urgent: [Wait(urgent, f"waiting for preempted job(s) {low} to checkpoint")]}


def test_scheduler_asks_a_running_elastic_job_to_grow_into_freed_gpus():
    rig = Rig(cluster=nodes(n=1))
    hog = rig.submit("hog", gpus=4)
    el = rig.submit("el", gpus=8, elastic=(2, 8))
    rig.step()
    rig.run(hog), rig.run(el)
    assert rig.job(el).replicas == 4
    rig.store.update(hog, lambda j: finish(j, "done"))
    d = rig.step()
    assert [(x.to, x.cause) for x in d[el] if isinstance(x, Resize)] == [(8, "grow")]
    job = rig.job(el)
    assert job.resize["to"] == 8 and len(job.placement) == 8 and rig.store.resize_requested(el)


def test_scheduler_places_nothing_on_a_quarantined_node():
    rig = Rig(cluster=nodes(n=2))
    rig.store.quarantine_node("n0", {"until": time.time() + 600, "reason": "flaky"})
    jid = rig.submit("q", gpus=8)
    rig.step()
    assert {p.node for p in rig.job(jid).placement} == {"n1"}


def test_scheduler_takes_its_policy_from_the_queue_table_each_cycle():
    fifo = QueueTable(queues=(Queue("default"),), policy="fifo")
    rig = Rig(cluster=nodes(n=1), queues=fifo)
    big = rig.submit("big", gpus=16)
    small = rig.submit("small", gpus=1)
    d = rig.step()
    assert d[small] == [Wait(small, f"behind job {big} in the FIFO queue")]
    rig.store.set_info("queues", QueueTable().to_json())  # back to gang: small backfills
    assert isinstance(rig.step()[small][0], Admit)
