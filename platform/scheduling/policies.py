"""Scheduling policies: pure functions from a snapshot to decisions.

The scheduler actor takes a snapshot (queued jobs, active jobs, nodes, queue
table), asks the policy for decisions, and applies them. Policies never touch
Redis or Ray, so tests build a snapshot by hand and check the decisions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Protocol

from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.jobs.state import JobRecord
from kuangchao.platform.scheduling.placement import (
    Infeasible,
    JobShape,
    PlacementPlan,
    Traffic,
    place,
    traffic_from_spec,
)
from kuangchao.platform.scheduling.queues import QueueTable
from kuangchao.platform.spec.defaults import value
from kuangchao.platform.spec.elastic import elastic_range

MAX_VICTIM_CANDIDATES = 64


@dataclass(frozen=True)
class Snapshot:
    """An immutable view of the cluster for one scheduling cycle."""

    nodes: tuple[NodeInfo, ...]
    queued: tuple[JobRecord, ...]
    active: tuple[JobRecord, ...]
    queues: QueueTable = field(default_factory=QueueTable)

    def used_gpus(self) -> dict[str, set[int]]:
        used: dict[str, set[int]] = {}
        for job in self.active:
            for p in job.placement:
                used.setdefault(p.node, set()).update(p.gpus)
        return used

    def queue_usage(self) -> dict[str, int]:
        usage = {q: 0 for q in self.queues.names}
        for job in self.active:
            usage[job.queue] = usage.get(job.queue, 0) + job.gpus
        return usage


@dataclass(frozen=True)
class Admit:
    job_id: str
    plan: PlacementPlan
    replicas: int = 0  # data-parallel size admitted at (the plan's replica count)
    solve_s: float = 0.0  # time the placement solver took for it (kc_placement_solve_seconds)


@dataclass(frozen=True)
class Wait:
    job_id: str
    reason: str


@dataclass(frozen=True)
class Preempt:
    """Checkpoint and requeue `job_id` so that `for_job` can run."""

    job_id: str
    for_job: str
    reason: str


@dataclass(frozen=True)
class Resize:
    """Change a running elastic job's data-parallel size to `to` replicas.

    A grow carries the plan of the added replicas (their GPUs are held from
    now on); a shrink names the job it makes room for, if any.
    """

    job_id: str
    to: int
    cause: str
    reason: str
    plan: PlacementPlan | None = None
    for_job: str | None = None


Decision = Admit | Wait | Preempt | Resize


class AdmissionPolicy(Protocol):
    name: str

    def decide(self, snap: Snapshot) -> list[Decision]: ...


def job_shape(job: JobRecord) -> JobShape:
    return shape_of(job.spec)


def shape_of(spec_doc: dict) -> JobShape:
    """The parallel layout of a spec document."""
    return JobShape(
        dp=int(value(spec_doc, "parallel", "data_parallel_size")),
        tp=int(value(spec_doc, "parallel", "tensor_parallel_size")),
        pp=int(value(spec_doc, "parallel", "pipeline_parallel_size")),
        gpus_per_rank=int(value(spec_doc, "parallel", "gpus_per_rank")),
    )


def order_key(job: JobRecord) -> tuple:
    """Queue order: higher priority first, then first come, first served."""
    return (-job.priority, job.created_at, job.id)


def _union(*maps: dict[str, set[int]]) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for m in maps:
        for node, ids in m.items():
            out.setdefault(node, set()).update(ids)
    return out


def _plan_gpus(plan: PlacementPlan) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for s in plan.slots:
        out.setdefault(s.node, set()).update(s.gpus)
    return out


def _job_gpus(job: JobRecord) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for p in job.placement:
        out.setdefault(p.node, set()).update(p.gpus)
    return out


def _without(used: dict[str, set[int]], drop: dict[str, set[int]]) -> dict[str, set[int]]:
    return {n: ids - drop.get(n, set()) for n, ids in used.items()}


def _free_count(nodes: tuple[NodeInfo, ...], used: dict[str, set[int]]) -> int:
    return sum(n.gpus - len(used.get(n.name, ())) for n in nodes if n.alive)


class FifoPolicy:
    """Strict first-in-first-out gang admission, one queue, no preemption.

    A job that does not fit blocks the ones behind it, so a large job is never
    starved by a stream of small ones.
    """

    name = "fifo"

    def decide(self, snap: Snapshot) -> list[Decision]:
        used = snap.used_gpus()
        out: list[Decision] = []
        blocked_by: str | None = None
        for job in sorted(snap.queued, key=lambda j: (j.created_at, j.id)):
            if blocked_by is not None:
                out.append(Wait(job.id, f"behind job {blocked_by} in the FIFO queue"))
                continue
            rng, shape = elastic_range(job.spec), job_shape(job)
            result: PlacementPlan | Infeasible = Infeasible("no admissible size")
            n = 0
            started = time.perf_counter()
            for n in rng.sizes(upto=rng.target(job.desired_replicas)):
                result = place(snap.nodes, used, replace(shape, dp=n))
                if isinstance(result, PlacementPlan):
                    break
            if isinstance(result, Infeasible):
                out.append(Wait(job.id, result.reason))
                blocked_by = job.id
                continue
            used = _union(used, _plan_gpus(result))
            out.append(Admit(job.id, result, n, time.perf_counter() - started))
        return out


class GangPolicy:
    """Queues with quotas, priorities, gang admission, backfill and preemption.

    Jobs are taken by priority, then arrival. Each is admitted whole or not at
    all, within its queue's quota (guarantee plus borrowing). The first job
    blocked for lack of GPUs is the head: the free GPUs it would take now are
    held for it, and later jobs may backfill only around them, so they never
    delay it. A blocked job may preempt active jobs of lower priority, or jobs
    of queues borrowing beyond their guarantee while its own queue is below
    its guarantee; victims are checkpointed and requeued, never killed
    without a checkpoint attempt.
    """

    name = "gang"

    def decide(self, snap: Snapshot) -> list[Decision]:
        state = _CycleState(snap)
        for job in sorted(snap.queued, key=order_key):
            state.out.extend(self._one(job, state))
        state.out.extend(elastic_resizes(state))
        return state.out

    def _one(self, job: JobRecord, st: _CycleState) -> list[Decision]:
        snap = st.snap
        queue = snap.queues.get(job.queue)
        if queue is None:
            return [Wait(job.id, f"queue {job.queue!r} does not exist; known queues: "
                                 f"{', '.join(snap.queues.names)}")]
        in_use = st.usage.get(queue.name, 0)
        rng = elastic_range(job.spec)
        per = rng.gpus_per_replica
        # An elastic job takes the most replicas that fit, up to its target, and at least its minimum.
        sizes = rng.sizes(upto=rng.target(job.desired_replicas)) or [rng.min_replicas]
        fitting = [n for n in sizes if in_use + n * per <= queue.limit]
        if not fitting:
            return [Wait(job.id, f"quota {queue.name}: {in_use}/{queue.limit:g} GPUs in use")]
        least = fitting[-1]
        if least * per > st.total:  # can never fit: it must not hold GPUs back from others
            return [Wait(job.id, f"needs {least * per} GPUs, the cluster has {st.total}")]
        if job.id in st.awaiting:  # victims are checkpointing or shrinking for this job
            st.hold(st.awaiting[job.id])
            ids = ", ".join(sorted(st.awaiting_ids[job.id]))
            if st.awaiting_shrink.get(job.id):
                return [Wait(job.id, f"waiting for job(s) {ids} to shrink")]
            return [Wait(job.id, f"waiting for preempted job(s) {ids} to checkpoint")]
        shape = job_shape(job)
        traffic = traffic_from_spec(job.spec)
        plan: PlacementPlan | Infeasible = Infeasible("no admissible size")
        started = time.perf_counter()
        for n in fitting:
            plan = st.try_place(replace(shape, dp=n), n * per, traffic)
            if isinstance(plan, PlacementPlan):
                st.take(_plan_gpus(plan))
                st.usage[queue.name] = in_use + n * per
                return [Admit(job.id, plan, n, time.perf_counter() - started)]
        shape, need = replace(shape, dp=least), least * per
        if snap.queues.preemption and not st.preempting:
            shrinks = shrink_victims(job, shape, need, st, lambda a: self._eligible(job, need, a, st))
            if shrinks:
                return self._shrink(job, shrinks, st)
            victims = self._victims(job, shape, need, st)
            if victims:
                st.preempting = True  # one preemption per cycle: the next cycle sees its effect
                for v in victims:
                    st.preempted.add(v.id)
                    st.hold(_job_gpus(v))
                names = ", ".join(v.id for v in victims)
                out: list[Decision] = [Preempt(v.id, job.id, f"preempted for higher-priority job {job.id}")
                                       for v in victims]
                return out + [Wait(job.id, f"preempting {names}")]
        assert isinstance(plan, Infeasible)
        reason = plan.reason
        if st.head is None:
            st.head = job.id
            st.hold(self._head_reservation(shape, st))
        elif st.free_unreserved >= need:
            reason = f"GPUs are held for job {st.head}, ahead in the queue"
        return [Wait(job.id, reason)]

    @staticmethod
    def _shrink(job: JobRecord, shrinks: list[tuple[JobRecord, int]],
                st: _CycleState) -> list[Decision]:
        """Shrink elastic jobs (instead of evicting them) to make room for `job`."""
        st.preempting = True
        out: list[Decision] = []
        for a, n in shrinks:
            st.preempted.add(a.id)
            st.hold(replica_gpus(a, n))
            out.append(Resize(a.id, n, "preemption",
                              f"shrinking to {n} replica(s) for higher-priority job {job.id}",
                              for_job=job.id))
        names = ", ".join(a.id for a, _ in shrinks)
        return out + [Wait(job.id, f"shrinking {names} to make room")]

    @staticmethod
    def _eligible(job: JobRecord, need: int, a: JobRecord, st: _CycleState) -> bool:
        """Whether active job `a` may give up GPUs for queued `job`."""
        snap = st.snap
        queue = snap.queues.get(job.queue)
        assert queue is not None
        if a.id in st.preempted or a.preempting_for or a.resize or not a.placement:
            return False
        if a.priority < job.priority:
            return True
        under_guarantee = st.usage.get(job.queue, 0) + need <= queue.guaranteed_gpus
        qa = snap.queues.get(a.queue)
        borrowing = qa is not None and st.usage.get(a.queue, 0) > qa.guaranteed_gpus
        return a.queue != job.queue and under_guarantee and borrowing

    def _head_reservation(self, shape: JobShape, st: _CycleState) -> dict[str, set[int]]:
        """The free GPUs the blocked head would take now: its largest partial fit."""
        lo, hi, best = 1, shape.dp - 1, None
        blocked = st.blocked()
        while lo <= hi:  # binary search the most replicas that fit
            mid = (lo + hi) // 2
            plan = place(st.snap.nodes, blocked, replace(shape, dp=mid))
            if isinstance(plan, PlacementPlan):
                best, lo = plan, mid + 1
            else:
                hi = mid - 1
        return _plan_gpus(best) if best else {}

    def _victims(self, job: JobRecord, shape: JobShape, need: int,
                 st: _CycleState) -> list[JobRecord]:
        snap = st.snap

        def eligible(a: JobRecord) -> bool:
            return self._eligible(job, need, a, st)

        cands = sorted((a for a in snap.active if eligible(a)),
                       key=lambda a: (a.priority, -(a.started_at or a.created_at), a.id))
        # Cheap bound first: even all candidates together may not free enough GPUs.
        reclaimable = sum(a.gpus for a in cands[:MAX_VICTIM_CANDIDATES])
        if st.free + reclaimable < need:
            return []
        chosen: list[JobRecord] = []
        freed: dict[str, set[int]] = {}
        for a in cands[:MAX_VICTIM_CANDIDATES]:
            chosen.append(a)
            freed = _union(freed, _job_gpus(a))
            blocked = _union(_without(st.used, freed), st.reserved)
            if isinstance(place(snap.nodes, blocked, shape), PlacementPlan):
                return self._minimal(chosen, shape, st)
        return []

    def _minimal(self, chosen: list[JobRecord], shape: JobShape,
                 st: _CycleState) -> list[JobRecord]:
        """Drop victims that turn out not to be needed, newest choices first."""
        keep = list(chosen)
        for a in reversed(chosen):
            trial = [v for v in keep if v.id != a.id]
            freed = _union(*(_job_gpus(v) for v in trial)) if trial else {}
            blocked = _union(_without(st.used, freed), st.reserved)
            if trial and isinstance(place(st.snap.nodes, blocked, shape), PlacementPlan):
                keep = trial
        return keep


class _CycleState:
    """What one `GangPolicy.decide` call has decided so far.

    GPUs only ever become taken (admitted) or held (reserved) within a cycle,
    never free again, so a shape that failed to place keeps failing: such
    failures are remembered and larger jobs of that shape fail fast.
    """

    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap
        self.used = snap.used_gpus()
        self.usage = snap.queue_usage()
        self.reserved: dict[str, set[int]] = {}
        self.total = sum(n.gpus for n in snap.nodes if n.alive)
        self.free_unreserved = _free_count(snap.nodes, self.used)
        self.free = self.free_unreserved
        self.head: str | None = None
        self.preempted: set[str] = set()
        self.preempting = False
        self.out: list[Decision] = []
        self._failed: dict[tuple[int, int, int], tuple[int, str]] = {}
        self.awaiting: dict[str, dict[str, set[int]]] = {}
        self.awaiting_ids: dict[str, set[str]] = {}
        self.awaiting_shrink: dict[str, bool] = {}
        for a in snap.active:
            # GPUs on their way to a queued job: a preempted job's, or what a shrink frees.
            for_job = a.preempting_for or (a.resize or {}).get("for_job")
            if for_job:
                gpus = _job_gpus(a) if a.preempting_for else replica_gpus(a, int(a.resize["to"]))
                self.awaiting[for_job] = _union(self.awaiting.get(for_job, {}), gpus)
                self.awaiting_ids.setdefault(for_job, set()).add(a.id)
                self.awaiting_shrink[for_job] = not a.preempting_for

    def blocked(self) -> dict[str, set[int]]:
        return _union(self.used, self.reserved)

    def try_place(self, shape: JobShape, gpus: int,
                  traffic: Traffic | None = None) -> PlacementPlan | Infeasible:
        if self.free < gpus:
            return Infeasible(f"needs {gpus} GPUs, {self.free} of {self.total} are free")
        key = (shape.tp, shape.pp, shape.gpus_per_rank)
        failed = self._failed.get(key)
        if failed is not None and shape.dp >= failed[0]:
            return Infeasible(failed[1])
        plan = place(self.snap.nodes, self.blocked(), shape, traffic)
        if isinstance(plan, Infeasible):
            self._failed[key] = (min(shape.dp, failed[0]) if failed else shape.dp, plan.reason)
        return plan

    def take(self, gpus: dict[str, set[int]]) -> None:
        """Admit: these free GPUs become used."""
        for node, ids in gpus.items():
            self.used.setdefault(node, set()).update(ids)
            self.free -= len(ids)
            self.free_unreserved -= len(ids)

    def hold(self, gpus: dict[str, set[int]]) -> None:
        """Reserve: nobody else may take these GPUs this cycle."""
        for node, ids in gpus.items():
            new = ids - self.reserved.get(node, set()) - self.used.get(node, set())
            self.free -= len(new)
            self.reserved.setdefault(node, set()).update(ids)


from kuangchao.platform.scheduling.elastic_policy import (  # noqa: E402 -- it builds on the helpers above
    elastic_resizes,
    replica_gpus,
    shrink_victims,
)

POLICIES: dict[str, type] = {"fifo": FifoPolicy, "gang": GangPolicy}


def make_policy(name: str) -> AdmissionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"scheduler policy {name!r} is unknown; choose one of {sorted(POLICIES)}"
        ) from None
