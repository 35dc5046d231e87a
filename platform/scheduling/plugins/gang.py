"""The gang policy: queues with quotas, priorities, gang admission, backfill,
preemption and elastic resizes, composed from the plugins (interface.py).

Jobs are taken by priority, then arrival. Each is admitted whole or not at
all, within its queue's quota (guarantee plus borrowing). A job that does not
fit first shrinks lower-priority elastic jobs, else preempts, else waits: the
first such job is the head, and later jobs backfill only around the GPUs it
would take. Running elastic jobs then shrink as asked, or grow while no
queued job wants GPUs. Before all of it, a running job that lost a node and keeps
its survivors' work gets its lost replicas placed elsewhere (relocation.py).
"""

from __future__ import annotations

from dataclasses import replace

from kuangchao.platform.scheduling.plugins.admission import GangAdmission
from kuangchao.platform.scheduling.plugins.backfill import HeadReservation
from kuangchao.platform.scheduling.plugins.cycle import Cycle
from kuangchao.platform.scheduling.plugins.decisions import Admit, Decision, Hold, Step, Wait
from kuangchao.platform.scheduling.plugins.elastic import ElasticGrow, ElasticShrink, resizable
from kuangchao.platform.scheduling.plugins.interface import (
    Admission,
    Backfill,
    Grow,
    Preemption,
    Quota,
    Shrink,
)
from kuangchao.platform.scheduling.plugins.preemption import CheckpointPreemption
from kuangchao.platform.scheduling.plugins.quota import QueueQuota
from kuangchao.platform.scheduling.plugins.relocation import LostReplicaRelocation
from kuangchao.platform.scheduling.plugins.snapshot import JobView, Snapshot, order_key


class GangPolicy:
    """The plugins in order over one snapshot; each may be swapped for another of its Protocol."""

    name = "gang"

    def __init__(self, quota: Quota | None = None, admission: Admission | None = None,
                 preemption: Preemption | None = None, shrink: Shrink | None = None,
                 grow: Grow | None = None, backfill: Backfill | None = None) -> None:
        self.quota = quota or QueueQuota()
        self.admission = admission or GangAdmission()
        self.preemption = preemption or CheckpointPreemption()
        self.shrink = shrink or ElasticShrink()
        self.grow = grow or ElasticGrow(self.quota)
        self.backfill = backfill or HeadReservation()
        self.relocation = LostReplicaRelocation()

    def decide(self, snap: Snapshot) -> list[Decision]:
        cycle = Cycle(snap)
        out: list[Decision] = [*self.relocation.decide(snap.active, cycle)]
        for job in sorted(snap.queued, key=order_key):
            out.extend(self._apply(cycle, self._queued(snap.view(job), cycle)))
        out.extend(self._running(snap, cycle))
        return out

    @staticmethod
    def _apply(cycle: Cycle, steps: tuple[Step, ...]) -> list[Decision]:
        """Record each step in the ledger; the decisions among them go back to the scheduler."""
        for step in steps:
            cycle.apply(step)
        return [s for s in steps if not isinstance(s, Hold)]

    def _queued(self, job: JobView, cycle: Cycle) -> tuple[Step, ...]:
        sized = self.quota.admissible(job, cycle)
        if isinstance(sized, Wait):
            return (sized,)
        pending = self.preemption.pending(job, cycle)
        if pending:
            return pending
        placed = self.admission.place(job, sized, cycle)
        if isinstance(placed, Admit):
            return (placed,)
        shape = replace(job.shape, dp=sized.least)
        need = sized.least * job.rng.gpus_per_replica
        return (self.shrink.make_room(job, shape, need, cycle)
                or self.preemption.evict(job, shape, need, cycle)
                or self.backfill.wait(job, shape, need, placed.reason, cycle))

    def _running(self, snap: Snapshot, cycle: Cycle) -> list[Decision]:
        """Requested shrinks and grows, after the queue had its turn; higher priority first.

        Each grow is applied before the next job's is sought: a grow takes GPUs.
        """
        gpus_wanted = cycle.head is not None or cycle.preempting or bool(cycle.awaiting)
        out: list[Decision] = []
        for record in sorted(snap.active, key=order_key):
            job = snap.view(record)
            if not resizable(job):
                continue
            step = self.shrink.requested(job) or (None if gpus_wanted else self.grow.grow(job, cycle))
            if step is not None:
                cycle.apply(step)
                out.append(step)
        return out
