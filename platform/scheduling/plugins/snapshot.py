"""The immutable view of the cluster one scheduling cycle decides on.

Each job comes with its spec resolved once per cycle (`JobView`): the typed
spec from the record, its elastic range, parallel shape and traffic, so no
plugin reads a raw spec document.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.jobs.state import JobRecord
from kuangchao.platform.placement.pools import Pool, pools_of
from kuangchao.platform.placement.solver import JobShape, PlacementPlan, Traffic, traffic_of
from kuangchao.platform.scheduling.plugins.decisions import GpuMap
from kuangchao.platform.spec.elastic import ElasticRange
from kuangchao.platform.spec.jobspec import JobSpec
from kuangchao.platform.spec.queues import QueueTable
from kuangchao.platform.spec.stored import spec_of


def shape_from(spec: JobSpec) -> JobShape:
    """The parallel layout of a typed spec, with the GPU types it accepts: every
    placement of the job (admission, grow, backfill, room-making, recovery)
    starts from this shape, so the type filter holds in all of them."""
    p, r = spec.parallel, spec.resources
    return JobShape(dp=p.data_parallel_size, tp=p.tensor_parallel_size,
                    pp=p.pipeline_parallel_size, gpus_per_rank=p.gpus_per_rank,
                    gpu_types=tuple(r.gpu_types), heterogeneous=r.heterogeneous)


def order_key(job: JobRecord) -> tuple:
    """Queue order: higher priority first, then first come, first served."""
    return (-job.priority, job.created_at, job.id)


@dataclass(frozen=True)
class JobView:
    """A job record with its stored spec resolved."""

    record: JobRecord
    spec: JobSpec
    rng: ElasticRange
    shape: JobShape
    traffic: Traffic

    @classmethod
    def of(cls, record: JobRecord) -> JobView:
        spec = spec_of(record.spec)
        return cls(record, spec, spec.elastic_range, shape_from(spec), traffic_of(spec))

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def replicas(self) -> int:
        """The data-parallel size it runs at now."""
        return self.record.replicas or len(self.record.placement) // self.rng.ranks_per_replica

    def gpus(self) -> GpuMap:
        """The GPUs it holds."""
        return by_node((p.node, p.gpus) for p in self.record.placement)

    def gpus_beyond(self, keep: int) -> GpuMap:
        """The GPUs it gives back when it keeps only its first `keep` replicas."""
        first_gone = keep * self.rng.ranks_per_replica
        return by_node((p.node, p.gpus) for p in self.record.placement if p.rank >= first_gone)


@dataclass(frozen=True)
class Snapshot:
    """An immutable view of the cluster for one scheduling cycle.

    `resolved` and `held` are what a kept snapshot (scheduling/snapshot_keeper.py)
    carries over from earlier cycles: the views of jobs unchanged since, and the
    GPUs active jobs hold per node. Left out, both are derived from the records.
    """

    nodes: tuple[NodeInfo, ...]
    queued: tuple[JobRecord, ...]
    active: tuple[JobRecord, ...]
    queues: QueueTable = field(default_factory=QueueTable)
    resolved: Mapping[str, JobView] | None = field(default=None, compare=False, repr=False)
    held: Mapping[str, frozenset[int]] | None = field(default=None, compare=False, repr=False)

    @cached_property
    def views(self) -> Mapping[str, JobView]:
        """Every job's resolved view, by id."""
        if self.resolved is not None:
            return self.resolved
        return {j.id: JobView.of(j) for j in (*self.queued, *self.active)}

    def view(self, job: JobRecord) -> JobView:
        return self.views[job.id]

    def used_gpus(self) -> dict[str, set[int]]:
        """The GPUs active jobs hold, per node (a fresh copy each call)."""
        if self.held is not None:
            return {node: set(ids) for node, ids in self.held.items()}
        return by_node((p.node, p.gpus) for job in self.active for p in job.placement)

    @cached_property
    def free_gpus(self) -> Mapping[str, frozenset[int]]:
        """Free capacity per live node."""
        used = self.used_gpus()
        return {n.name: frozenset(range(n.gpus)) - used.get(n.name, set())
                for n in self.nodes if n.alive}

    @property
    def total_gpus(self) -> int:
        return sum(n.gpus for n in self.nodes if n.alive)

    def queue_usage(self) -> dict[str, int]:
        usage = {q: 0 for q in self.queues.names}
        for job in self.active:
            usage[job.queue] = usage.get(job.queue, 0) + job.gpus
        return usage

    @cached_property
    def node_types(self) -> Mapping[str, str | None]:
        """Each node's GPU type, by name."""
        return {n.name: n.gpu_type for n in self.nodes}

    @cached_property
    def live_types(self) -> frozenset[str | None]:
        """The GPU types of the live nodes (asked once per waiting job: computed once)."""
        return frozenset(n.gpu_type for n in self.nodes if n.alive)

    def pools(self, gpu_types: tuple[str, ...]) -> list[Pool]:
        """`pools_of(self.nodes, gpu_types)`, computed once per cycle for each type list:
        thousands of queued jobs ask for the same few, and the nodes do not change."""
        memo = self._pools_memo
        if gpu_types not in memo:
            memo[gpu_types] = pools_of(self.nodes, gpu_types)
        return memo[gpu_types]

    @cached_property
    def _pools_memo(self) -> dict[tuple[str, ...], list[Pool]]:
        return {}

    def queue_type_usage(self) -> dict[str, dict[str, int]]:
        """GPUs each queue's active jobs hold, per GPU type (untyped GPUs are not counted)."""
        usage: dict[str, dict[str, int]] = {}
        for job in self.active:
            add_by_type(usage.setdefault(job.queue, {}),
                        by_node((p.node, p.gpus) for p in job.placement), self.node_types)
        return usage


def add_by_type(into: dict[str, int], gpus: GpuMap, types: Mapping[str, str | None]) -> None:
    """Count `gpus` into `into` by their nodes' GPU types."""
    for node, ids in gpus.items():
        t = types.get(node)
        if t is not None:
            into[t] = into.get(t, 0) + len(ids)


def by_node(pairs) -> GpuMap:
    """`(node, gpu ids)` pairs gathered into one map."""
    out: GpuMap = {}
    for node, ids in pairs:
        out.setdefault(node, set()).update(ids)
    return out


def plan_gpus(plan: PlacementPlan) -> GpuMap:
    return by_node((s.node, s.gpus) for s in plan.slots)


def union(*maps: GpuMap) -> GpuMap:
    return by_node(pair for m in maps for pair in m.items())


def without(used: GpuMap, drop: GpuMap) -> GpuMap:
    return {n: ids - drop.get(n, set()) for n, ids in used.items()}


def shape_of(spec_doc: Mapping) -> JobShape:
    """The parallel layout of a stored spec document."""
    return shape_from(spec_of(spec_doc))


def job_shape(job: JobRecord) -> JobShape:
    """The parallel layout of a job as its record was submitted."""
    return shape_of(job.spec)
