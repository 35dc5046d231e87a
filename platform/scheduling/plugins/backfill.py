"""Backfill around the blocked head of the queue, never into the GPUs it would take.

On a cluster of several GPU types a one-type job that fits nowhere now waits
for one pool, the one whose queue ahead of it is shortest
(platform/placement/pools.py); its wait names that pool, and as the head it
holds GPUs in that pool only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.placement.pools import Ahead, Pool, wait_pool
from kuangchao.platform.placement.solver import JobShape, PlacementPlan, place
from kuangchao.platform.scheduling.plugins.cycle import Cycle
from kuangchao.platform.scheduling.plugins.decisions import GpuMap, Hold, Step, Wait
from kuangchao.platform.scheduling.plugins.snapshot import JobView, order_key, plan_gpus


class HeadReservation:
    """The first job blocked for lack of GPUs is the head: the free GPUs it would take
    now are held for it, so later jobs backfill only around them and never delay it."""

    name = "backfill"

    def wait(self, job: JobView, shape: JobShape, need: int, reason: str,
             cycle: Cycle) -> tuple[Step, ...]:
        """How a job that does not fit waits: as the head (holding GPUs) or behind it."""
        caps = cycle.type_caps(job.record.queue)
        pool = self.pool(job, shape, need, cycle, caps)
        nodes: tuple[NodeInfo, ...] | None = None  # None: the whole cluster
        name, prefix = None, ""
        held_back = cycle.free_unreserved >= need  # it would fit, but for what is held
        if pool is not None:
            nodes, name, prefix = pool.nodes, pool.name, f"waiting for pool {pool.name}: "
            held_back = (pool.gpus - pool.in_use(cycle.used) >= need
                         and pool.in_use(cycle.blocked()) > pool.in_use(cycle.used))
            why = place(nodes, cycle.blocked(), shape, caps=caps)
            reason = why.reason if not isinstance(why, PlacementPlan) else reason
        if cycle.head is None:
            return (Hold(self.reservation(shape, cycle, nodes, caps), head=job.id),
                    Wait(job.id, prefix + reason, name))
        if held_back:
            reason = f"GPUs are held for job {cycle.head}, ahead in the queue"
        return (Wait(job.id, prefix + reason, name),)

    @staticmethod
    def pool(job: JobView, shape: JobShape, need: int, cycle: Cycle,
             caps: Mapping[str, int] | None = None) -> Pool | None:
        """The pool a one-type job waits for on a cluster of several types; None for a
        mixed job, on a one-type cluster, or when no single pool could ever hold it."""
        snap = cycle.snap
        if shape.heterogeneous or len(snap.live_types) < 2:
            return None
        pools = [p for p in snap.pools(shape.gpu_types)
                 if isinstance(place(p.nodes, {}, shape), PlacementPlan)]
        roomy = [p for p in pools if caps is None or caps.get(p.name, need) >= need]
        if not pools:
            return None
        mine = order_key(job.record)
        ahead = [Ahead(v.rng.target(v.record.desired_replicas) * v.rng.gpus_per_replica,
                       v.shape.gpu_types, cycle.wait_pools.get(v.id))
                 for r in snap.queued if r.id not in cycle.admitted and order_key(r) < mine
                 for v in (cycle.job(r.id),)]
        return wait_pool(roomy or pools, ahead, cycle.used)

    @staticmethod
    def reservation(shape: JobShape, cycle: Cycle, nodes: tuple[NodeInfo, ...] | None = None,
                    caps: Mapping[str, int] | None = None) -> GpuMap:
        """The free GPUs the blocked head would take now: its largest partial fit (on
        `nodes`, its pool, when given)."""
        lo, hi, best = 1, shape.dp - 1, None
        blocked = cycle.blocked() if nodes is not None else {}
        while lo <= hi:  # binary search the most replicas that fit
            mid = (lo + hi) // 2
            trial = replace(shape, dp=mid)
            # Cluster-wide, the cycle's index answers without rescanning every node.
            plan = (cycle.place(trial, caps=caps) if nodes is None
                    else place(nodes, blocked, trial, caps=caps))
            if isinstance(plan, PlacementPlan):
                best, lo = plan, mid + 1
            else:
                hi = mid - 1
        return plan_gpus(best) if best else {}
