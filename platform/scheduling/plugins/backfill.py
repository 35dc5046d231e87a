"""Backfill around the blocked head of the queue, never into the GPUs it would take."""

from __future__ import annotations

from dataclasses import replace

from kuangchao.platform.placement.solver import JobShape, PlacementPlan, place
from kuangchao.platform.scheduling.plugins.cycle import Cycle
from kuangchao.platform.scheduling.plugins.decisions import GpuMap, Hold, Step, Wait
from kuangchao.platform.scheduling.plugins.snapshot import JobView, plan_gpus


class HeadReservation:
    """The first job blocked for lack of GPUs is the head: the free GPUs it would take
    now are held for it, so later jobs backfill only around them and never delay it."""

    name = "backfill"

    def wait(self, job: JobView, shape: JobShape, need: int, reason: str,
             cycle: Cycle) -> tuple[Step, ...]:
        """How a job that does not fit waits: as the head (holding GPUs) or behind it."""
        if cycle.head is None:
            return Hold(self.reservation(shape, cycle), head=job.id), Wait(job.id, reason)
        if cycle.free_unreserved >= need:
            reason = f"GPUs are held for job {cycle.head}, ahead in the queue"
        return (Wait(job.id, reason),)

    @staticmethod
    def reservation(shape: JobShape, cycle: Cycle) -> GpuMap:
        """The free GPUs the blocked head would take now: its largest partial fit."""
        lo, hi, best = 1, shape.dp - 1, None
        blocked = cycle.blocked()
        while lo <= hi:  # binary search the most replicas that fit
            mid = (lo + hi) // 2
            plan = place(cycle.snap.nodes, blocked, replace(shape, dp=mid))
            if isinstance(plan, PlacementPlan):
                best, lo = plan, mid + 1
            else:
                hi = mid - 1
        return plan_gpus(best) if best else {}
