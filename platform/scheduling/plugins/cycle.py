"""The ledger of one cycle: what the decisions taken so far have used and held.

Plugins read it; only the composition writes it, through `apply`, once per
decision a plugin returned. GPUs only ever become taken (admitted) or held
(reserved) within a cycle, never free again, so a shape that failed to place
keeps failing: such failures are remembered and larger jobs of that shape
fail fast (a cache: it changes no outcome). Per-type quota room only shrinks
within a cycle too, and is part of the remembered shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from kuangchao.platform.placement.index import FreeIndex
from kuangchao.platform.placement.pools import capacity_problem
from kuangchao.platform.placement.solver import (
    Infeasible,
    JobShape,
    PlacementPlan,
    Traffic,
    place_on,
)
from kuangchao.platform.scheduling.plugins.decisions import (
    Admit,
    GpuMap,
    Hold,
    Preempt,
    Relocate,
    Resize,
    Step,
    Wait,
)
from kuangchao.platform.scheduling.plugins.snapshot import (
    JobView,
    Snapshot,
    add_by_type,
    plan_gpus,
    union,
)


class Cycle:
    """What one policy run has decided so far, over its snapshot."""

    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap
        self.used = snap.used_gpus()
        self.usage = snap.queue_usage()
        self.type_usage = snap.queue_type_usage()
        self.reserved: GpuMap = {}
        self.total = snap.total_gpus
        self.free_unreserved = sum(len(ids) for ids in snap.free_gpus.values())
        self.free = self.free_unreserved
        self.head: str | None = None
        self.preempted: set[str] = set()
        self.preempting = False
        self._failed: dict[tuple, tuple[int, str]] = {}
        self._never: dict[tuple, str | None] = {}
        self.admitted: set[str] = set()
        self.wait_pools: dict[str, str] = {}  # queued job -> the GPU pool it waits for
        self.awaiting: dict[str, GpuMap] = {}
        self.awaiting_ids: dict[str, set[str]] = {}
        self.awaiting_shrink: dict[str, bool] = {}
        # What is blocked (used or held), indexed by leaf: kept in step with `used` and
        # `reserved` by `_take` and `_hold`, so each placement in this cycle reads
        # the free group slots without rescanning every node.
        self.index = FreeIndex(snap.nodes, self.used)
        for a in snap.active:
            # GPUs on their way to a queued job: a preempted job's, or what a shrink frees.
            for_job = a.preempting_for or (a.resize or {}).get("for_job")
            if for_job:
                v = snap.view(a)
                gpus = v.gpus() if a.preempting_for else v.gpus_beyond(int(a.resize["to"]))
                self.awaiting[for_job] = union(self.awaiting.get(for_job, {}), gpus)
                self.awaiting_ids.setdefault(for_job, set()).add(a.id)
                self.awaiting_shrink[for_job] = not a.preempting_for

    def job(self, job_id: str) -> JobView:
        return self.snap.views[job_id]

    def blocked(self) -> GpuMap:
        """GPUs nobody may take any more this cycle: used or held."""
        return union(self.used, self.reserved)

    def type_caps(self, queue: str) -> dict[str, int] | None:
        """GPUs of each type `queue` may still take under its per-type limits; None
        when it has none (or is unknown)."""
        q = self.snap.queues.get(queue)
        if q is None or not q.gpu_types:
            return None
        return q.type_room(self.type_usage.get(queue, {}))

    def never_fits(self, shape: JobShape, gpus: int) -> str | None:
        """Why a job of `shape`'s GPU types could never get `gpus` GPUs here, or None
        (remembered per types and size: many queued jobs ask alike)."""
        key = (shape.gpu_types, shape.heterogeneous, gpus)
        if key not in self._never:
            self._never[key] = capacity_problem(self.snap.nodes, shape.gpu_types,
                                                shape.heterogeneous, gpus)
        return self._never[key]

    def try_place(self, shape: JobShape, gpus: int, traffic: Traffic | None = None,
                  caps: Mapping[str, int] | None = None) -> PlacementPlan | Infeasible:
        if self.free < gpus:
            return Infeasible(f"needs {gpus} GPUs, {self.free} of {self.total} are free")
        key = (replace(shape, dp=0), tuple(sorted((caps or {}).items())))
        failed = self._failed.get(key)
        if failed is not None and shape.dp >= failed[0]:
            return Infeasible(failed[1])
        plan = self.place(shape, traffic, caps)
        if isinstance(plan, Infeasible):
            self._failed[key] = (min(shape.dp, failed[0]) if failed else shape.dp, plan.reason)
        return plan

    def place(self, shape: JobShape, traffic: Traffic | None = None,
              caps: Mapping[str, int] | None = None) -> PlacementPlan | Infeasible:
        """`place(snap.nodes, blocked(), ...)`, over the cycle's kept index."""
        return place_on(self.index, shape, traffic, caps)

    def apply(self, step: Step) -> None:
        """Record the effect of one decision on what is free."""
        if isinstance(step, Hold):
            if step.head is not None:
                self.head = step.head
            self._hold(step.gpus)
        elif isinstance(step, Admit):
            job = self.job(step.job_id)
            self.admitted.add(job.id)
            self._take(plan_gpus(step.plan), job, step.replicas * job.rng.gpus_per_replica)
        elif isinstance(step, Wait) and step.pool is not None:
            self.wait_pools[step.job_id] = step.pool
        elif isinstance(step, Preempt):
            self._yield(step.job_id, self.job(step.job_id).gpus())
        elif isinstance(step, Resize) and step.cause == "preemption":
            self._yield(step.job_id, self.job(step.job_id).gpus_beyond(step.to))
        elif isinstance(step, Resize) and step.plan is not None:
            job = self.job(step.job_id)
            self._take(plan_gpus(step.plan), job, (step.to - job.replicas) * job.rng.gpus_per_replica)
        elif isinstance(step, Relocate) and step.plan is not None:
            # The job's size is unchanged: the lost node's GPUs leave its count as these join.
            self._take(plan_gpus(step.plan), self.job(step.job_id), 0)

    def _take(self, gpus: GpuMap, job: JobView, quota_gpus: int) -> None:
        """Admit or grow: these free GPUs become used, and count against the job's queue."""
        for node, ids in gpus.items():
            self.used.setdefault(node, set()).update(ids)
            self.free -= len(ids)
            self.free_unreserved -= len(ids)
        self.index.take(gpus)
        queue = job.record.queue
        self.usage[queue] = self.usage.get(queue, 0) + quota_gpus
        add_by_type(self.type_usage.setdefault(queue, {}), gpus, self.snap.node_types)

    def _yield(self, job_id: str, gpus: GpuMap) -> None:
        """A running job gives GPUs up (evicted or shrunk): held for the job it yields to."""
        self.preempting = True  # one preemption per cycle: the next cycle sees its effect
        self.preempted.add(job_id)
        self._hold(gpus)

    def _hold(self, gpus: GpuMap) -> None:
        """Reserve: nobody else may take these GPUs this cycle."""
        for node, ids in gpus.items():
            new = ids - self.reserved.get(node, set()) - self.used.get(node, set())
            self.free -= len(new)
            self.reserved.setdefault(node, set()).update(ids)
        self.index.take(gpus)
