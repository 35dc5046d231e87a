"""The elastic plugins: shrink for priority or on request, and grow into free GPUs.

- **Shrink for priority.** A queued job that does not fit takes replicas from
  lower-priority elastic jobs, down to their minimum, before anyone is
  evicted. The replicas dropped are the highest-numbered ones, so the
  survivors keep their ranks.
- **Shrink on request.** A user asked (`kc scale`) for fewer replicas than it has.
- **Grow.** A running elastic job below its target (its `kc scale` size, else
  `max_replicas`) takes free GPUs for more replicas, but only while no queued
  job waits for GPUs: a queued job always comes first, and growing into GPUs
  another job is about to need would only shrink it again. The added replicas
  are placed by the same solver as any job, as one unit, so every replica
  keeps its tensor-parallel groups inside an island and its pipeline inside a leaf,
  and stays on the job's GPU type (its own pool for a one-type job).
"""

from __future__ import annotations

from dataclasses import replace

from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.jobs.state import JobState
from kuangchao.platform.placement.solver import JobShape, PlacementPlan, place
from kuangchao.platform.scheduling.plugins.cycle import Cycle
from kuangchao.platform.scheduling.plugins.decisions import GpuMap, Resize, Step, Wait
from kuangchao.platform.scheduling.plugins.preemption import (
    MAX_VICTIM_CANDIDATES,
    fits_once_freed,
    may_yield,
    preemption_open,
    victim_order,
)
from kuangchao.platform.scheduling.plugins.quota import QueueQuota
from kuangchao.platform.scheduling.plugins.snapshot import JobView, union


def resizable(job: JobView) -> bool:
    """Running, elastic, placed, and neither resizing nor being preempted."""
    r = job.record
    return (r.state is JobState.RUNNING and r.resize is None and not r.preempting_for
            and bool(r.placement) and job.rng.elastic)


class ElasticShrink:
    """Take replicas from elastic jobs: for a higher-priority job, or as their user asked."""

    name = "shrink"

    def make_room(self, job: JobView, shape: JobShape, need: int,
                  cycle: Cycle) -> tuple[Step, ...]:
        """Shrinks that let `job` fit at `shape`, then its wait; empty when none would."""
        if not preemption_open(cycle):
            return ()
        shrinks = self.victims(job, shape, need, cycle)
        if not shrinks:
            return ()
        names = ", ".join(a.id for a, _ in shrinks)
        return (*(Resize(a.id, n, "preemption",
                         f"shrinking to {n} replica(s) for higher-priority job {job.id}",
                         for_job=job.id) for a, n in shrinks),
                Wait(job.id, f"shrinking {names} to make room"))

    @staticmethod
    def victims(job: JobView, shape: JobShape, need: int,
                cycle: Cycle) -> list[tuple[JobView, int]]:
        """Elastic jobs to shrink, and to what size, so that `job` (at `shape`) fits.

        Lowest priority first, then the most recently started; each is taken
        down one admissible size at a time and only as far as needed. Empty
        when even every candidate at its minimum would not make room.
        """
        eligible = (cycle.job(a.id) for a in sorted(cycle.snap.active, key=victim_order)
                    if may_yield(job, need, a, cycle))
        cands = [a for a in eligible if resizable(a) and a.replicas > a.rng.min_replicas]
        cands = cands[:MAX_VICTIM_CANDIDATES]
        reclaimable = sum((a.replicas - a.rng.min_replicas) * a.rng.gpus_per_replica for a in cands)
        if cycle.free + reclaimable < need:
            return []
        chosen: list[tuple[JobView, int]] = []
        freed: GpuMap = {}
        caps = cycle.type_caps(job.record.queue)
        for a in cands:
            for n in a.rng.sizes(upto=a.replicas - 1):
                if fits_once_freed(shape, union(freed, a.gpus_beyond(n)), cycle, caps):
                    return [*chosen, (a, n)]
            smallest = a.rng.sizes()[-1]
            freed = union(freed, a.gpus_beyond(smallest))
            chosen.append((a, smallest))
        return []

    @staticmethod
    def requested(job: JobView) -> Resize | None:
        """A shrink to the size the user asked for, when that is below the current one."""
        target = job.rng.target(job.record.desired_replicas)
        if target >= job.replicas:
            return None
        return Resize(job.id, target, "requested",
                      f"shrinking to {target} replica(s) as asked (kc scale)")


def grow_nodes(job: JobView, cycle: Cycle) -> tuple[NodeInfo, ...]:
    """The nodes a grow may use: a one-type job's added replicas join its own pool
    (the type of the nodes it runs on), a mixed job's go to any type it accepts.
    Empty when a one-type job's nodes are no longer known (recovery will re-place it)."""
    nodes = cycle.snap.nodes
    if job.shape.heterogeneous:
        return nodes
    kinds = {cycle.snap.node_types[p.node] for p in job.record.placement
             if p.node in cycle.snap.node_types}
    if len(kinds) != 1:
        return ()
    (kind,) = kinds
    return tuple(n for n in nodes if n.gpu_type == kind)


class ElasticGrow:
    """Grow a running elastic job towards its target, within its queue's quota."""

    name = "grow"

    def __init__(self, quota: QueueQuota) -> None:
        self.quota = quota

    def grow(self, job: JobView, cycle: Cycle) -> Resize | None:
        """The largest admissible grow that fits now, or None."""
        rng, cur = job.rng, job.replicas
        target = rng.target(job.record.desired_replicas)
        nodes = grow_nodes(job, cycle)
        if not nodes:
            return None
        for n in rng.sizes(upto=target):
            if n <= cur:
                break
            added = (n - cur) * rng.gpus_per_replica
            if not self.quota.room(job.record.queue, added, cycle):
                continue
            plan = place(nodes, cycle.blocked(), replace(job.shape, dp=n - cur),
                         job.traffic, cycle.type_caps(job.record.queue))
            if isinstance(plan, PlacementPlan):
                why = "as asked (kc scale)" if job.record.desired_replicas else "capacity is free"
                return Resize(job.id, n, "grow", f"growing from {cur} to {n} replica(s): {why}",
                              plan=plan)
        return None
