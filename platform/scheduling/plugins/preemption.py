"""Preemption: who may give up GPUs for a blocked job, and whom to evict.

A blocked job may take GPUs from active jobs of lower priority, or from jobs
of queues borrowing beyond their guarantee while its own queue is below its
guarantee. Victims are checkpointed and requeued, never killed without a
checkpoint attempt; at most one preemption (or shrink) is started per cycle,
so the next cycle sees its effect.
"""

from __future__ import annotations

from collections.abc import Mapping

from kuangchao.platform.jobs.state import JobRecord
from kuangchao.platform.placement.solver import JobShape, PlacementPlan, place
from kuangchao.platform.scheduling.plugins.cycle import Cycle
from kuangchao.platform.scheduling.plugins.decisions import GpuMap, Hold, Preempt, Step, Wait
from kuangchao.platform.scheduling.plugins.snapshot import JobView, union, without

MAX_VICTIM_CANDIDATES = 64


def preemption_open(cycle: Cycle) -> bool:
    """Whether this cycle may still start a preemption or a shrink for priority."""
    return cycle.snap.queues.preemption and not cycle.preempting


def victim_order(a: JobRecord) -> tuple:
    """Lowest priority first, then the most recently started."""
    return (a.priority, -(a.started_at or a.created_at), a.id)


def may_yield(job: JobView, need: int, a: JobRecord, cycle: Cycle) -> bool:
    """Whether active job `a` may give up GPUs for queued `job`, which needs `need` GPUs."""
    queues = cycle.snap.queues
    queue = queues.get(job.record.queue)
    assert queue is not None
    if a.id in cycle.preempted or a.preempting_for or a.resize or not a.placement:
        return False
    if a.priority < job.record.priority:
        return True
    under_guarantee = cycle.usage.get(job.record.queue, 0) + need <= queue.guaranteed_gpus
    qa = queues.get(a.queue)
    borrowing = qa is not None and cycle.usage.get(a.queue, 0) > qa.guaranteed_gpus
    return a.queue != job.record.queue and under_guarantee and borrowing


def fits_once_freed(shape: JobShape, freed: GpuMap, cycle: Cycle,
                    caps: Mapping[str, int] | None = None) -> bool:
    """Whether `shape` places once the `freed` GPUs are given up (held GPUs stay held),
    on its GPU types and within the per-type quota room `caps`: making room on a
    type the job may not use would evict for nothing."""
    blocked = union(without(cycle.used, freed), cycle.reserved)
    return isinstance(place(cycle.snap.nodes, blocked, shape, caps=caps), PlacementPlan)


class CheckpointPreemption:
    """Evict the fewest, lowest-priority, youngest eligible jobs that make room."""

    name = "preemption"

    def pending(self, job: JobView, cycle: Cycle) -> tuple[Step, ...]:
        """A job whose victims are still checkpointing or shrinking waits, holding what they free."""
        if job.id not in cycle.awaiting:
            return ()
        ids = ", ".join(sorted(cycle.awaiting_ids[job.id]))
        if cycle.awaiting_shrink.get(job.id):
            wait = Wait(job.id, f"waiting for job(s) {ids} to shrink")
        else:
            wait = Wait(job.id, f"waiting for preempted job(s) {ids} to checkpoint")
        return Hold(cycle.awaiting[job.id]), wait

    def evict(self, job: JobView, shape: JobShape, need: int, cycle: Cycle) -> tuple[Step, ...]:
        """Preempts that let `job` fit at `shape`, then its wait; empty when none would."""
        if not preemption_open(cycle):
            return ()
        victims = self.victims(job, shape, need, cycle)
        if not victims:
            return ()
        names = ", ".join(v.id for v in victims)
        return (*(Preempt(v.id, job.id, f"preempted for higher-priority job {job.id}")
                  for v in victims), Wait(job.id, f"preempting {names}"))

    def victims(self, job: JobView, shape: JobShape, need: int, cycle: Cycle) -> list[JobView]:
        cands = [cycle.job(a.id) for a in sorted(
            (a for a in cycle.snap.active if may_yield(job, need, a, cycle)), key=victim_order)]
        cands = cands[:MAX_VICTIM_CANDIDATES]
        # Cheap bound first: even all candidates together may not free enough GPUs.
        if cycle.free + sum(v.record.gpus for v in cands) < need:
            return []
        freed: GpuMap = {}
        caps = cycle.type_caps(job.record.queue)
        for i, v in enumerate(cands):
            freed = union(freed, v.gpus())
            if fits_once_freed(shape, freed, cycle, caps):
                return self._minimal(cands[:i + 1], shape, cycle, caps)
        return []

    @staticmethod
    def _minimal(chosen: list[JobView], shape: JobShape, cycle: Cycle,
                 caps: Mapping[str, int] | None) -> list[JobView]:
        """Drop victims that turn out not to be needed, newest choices first."""
        keep = list(chosen)
        for v in reversed(chosen):
            trial = [k for k in keep if k.id != v.id]
            if trial and fits_once_freed(shape, union(*(k.gpus() for k in trial)), cycle, caps):
                keep = trial
        return keep
