"""The elastic half of the gang policy: grow, shrink on request, shrink for priority.

Pure, like the rest of the policy: a cycle's state in, decisions out.

- **Grow.** A running elastic job below its target (its `kc scale` size, else
  `max_replicas`) takes free GPUs for more replicas, but only while no queued
  job waits for GPUs: a queued job always comes first, and growing into GPUs
  another job is about to need would only shrink it again.
- **Shrink on request.** A user asked for fewer replicas than it has.
- **Shrink for priority.** A queued job that does not fit takes replicas from
  lower-priority elastic jobs, down to their minimum, before the policy
  evicts anyone. The replicas dropped are the highest-numbered ones, so the
  survivors keep their ranks.

The added replicas of a grow are placed by the same solver as any job, one
replica at a time as a unit, so every replica keeps its tensor-parallel
groups inside an island and its pipeline inside a leaf.

The scheduler imports this through `kuangchao.platform.scheduling.policies`; the
imports of that module are deferred to call time because it imports this one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from kuangchao.platform.jobs.state import JobRecord, JobState
from kuangchao.platform.scheduling.placement import JobShape, PlacementPlan, place, traffic_from_spec
from kuangchao.platform.spec.elastic import elastic_range

if TYPE_CHECKING:
    from kuangchao.platform.scheduling.policies import Decision, _CycleState


def current_replicas(job: JobRecord) -> int:
    rng = elastic_range(job.spec)
    return job.replicas or len(job.placement) // rng.ranks_per_replica


def replica_gpus(job: JobRecord, keep: int) -> dict[str, set[int]]:
    """The GPUs a job gives back when it keeps only its first `keep` replicas."""
    first_gone = keep * elastic_range(job.spec).ranks_per_replica
    out: dict[str, set[int]] = {}
    for p in job.placement:
        if p.rank >= first_gone:
            out.setdefault(p.node, set()).update(p.gpus)
    return out


def _resizable(job: JobRecord) -> bool:
    return (job.state is JobState.RUNNING and job.resize is None and not job.preempting_for
            and bool(job.placement) and elastic_range(job.spec).elastic)


def elastic_resizes(st: _CycleState) -> list[Decision]:
    """Grows and requested shrinks, after the queue had its turn this cycle."""
    from kuangchao.platform.scheduling.policies import Resize, _plan_gpus, job_shape, order_key

    snap, out = st.snap, []
    gpus_wanted = st.head is not None or st.preempting or bool(st.awaiting)
    for job in sorted(snap.active, key=order_key):  # higher priority grows first
        if not _resizable(job):
            continue
        rng, cur = elastic_range(job.spec), current_replicas(job)
        target = rng.target(job.desired_replicas)
        if target < cur:
            out.append(Resize(job.id, target, "requested", f"shrinking to {target} replica(s) "
                                                           "as asked (kc scale)"))
            continue
        if target == cur or gpus_wanted:
            continue
        queue = snap.queues.get(job.queue)
        in_use = st.usage.get(job.queue, 0)
        per = rng.gpus_per_replica
        for n in rng.sizes(upto=target):
            if n <= cur:
                break
            added = (n - cur) * per
            if queue is not None and in_use + added > queue.limit:
                continue
            plan = place(snap.nodes, st.blocked(), replace(job_shape(job), dp=n - cur),
                         traffic_from_spec(job.spec))
            if isinstance(plan, PlacementPlan):
                st.take(_plan_gpus(plan))
                st.usage[job.queue] = in_use + added
                why = "as asked (kc scale)" if job.desired_replicas else "capacity is free"
                out.append(Resize(job.id, n, "grow", f"growing from {cur} to {n} replica(s): {why}",
                                  plan=plan))
                break
    return out


def shrink_victims(job: JobRecord, shape: JobShape, need: int, st: _CycleState,
                   eligible: Callable[[JobRecord], bool]) -> list[tuple[JobRecord, int]]:
    """Elastic jobs to shrink, and to what size, so that `job` (at `shape`) fits.

    Lowest priority first, then the most recently started; each is taken down
    one admissible size at a time and only as far as needed. Empty when even
    every candidate at its minimum would not make room.
    """
    from kuangchao.platform.scheduling.policies import MAX_VICTIM_CANDIDATES, _union, _without

    snap = st.snap
    cands = sorted((a for a in snap.active if _resizable(a) and eligible(a)
                    and current_replicas(a) > elastic_range(a.spec).min_replicas),
                   key=lambda a: (a.priority, -(a.started_at or a.created_at), a.id))
    reclaimable = sum((current_replicas(a) - elastic_range(a.spec).min_replicas)
                      * elastic_range(a.spec).gpus_per_replica
                      for a in cands[:MAX_VICTIM_CANDIDATES])
    if st.free + reclaimable < need:
        return []
    chosen: list[tuple[JobRecord, int]] = []
    freed: dict[str, set[int]] = {}
    for a in cands[:MAX_VICTIM_CANDIDATES]:
        rng = elastic_range(a.spec)
        for n in rng.sizes(upto=current_replicas(a) - 1):
            trial = _union(freed, replica_gpus(a, n))
            blocked = _union(_without(st.used, trial), st.reserved)
            if isinstance(place(snap.nodes, blocked, shape), PlacementPlan):
                return [*chosen, (a, n)]
        smallest = rng.sizes()[-1]
        freed = _union(freed, replica_gpus(a, smallest))
        chosen.append((a, smallest))
    return []
