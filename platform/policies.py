"""Scheduling policies: pure functions from a snapshot to decisions.

The scheduler actor takes a snapshot (queued jobs, active placements, nodes),
asks the policy for decisions, and applies them. Policies never touch Redis or
Ray, so tests build a snapshot by hand and check the decisions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kuangchao.platform.placement import Infeasible, JobShape, PlacementPlan, place
from kuangchao.platform.state import JobRecord
from kuangchao.platform.topology import NodeInfo


@dataclass(frozen=True)
class Snapshot:
    """An immutable view of the cluster for one scheduling cycle."""

    nodes: tuple[NodeInfo, ...]
    queued: tuple[JobRecord, ...]
    active: tuple[JobRecord, ...]

    def used_gpus(self) -> dict[str, set[int]]:
        used: dict[str, set[int]] = {}
        for job in self.active:
            for p in job.placement:
                used.setdefault(p.node, set()).update(p.gpus)
        return used


@dataclass(frozen=True)
class Admit:
    job_id: str
    plan: PlacementPlan


@dataclass(frozen=True)
class Wait:
    job_id: str
    reason: str


Decision = Admit | Wait


class AdmissionPolicy(Protocol):
    def decide(self, snap: Snapshot) -> list[Decision]: ...


def job_shape(job: JobRecord) -> JobShape:
    return shape_of(job.spec)


def shape_of(spec_doc: dict) -> JobShape:
    """The parallel layout of a spec document."""
    par = spec_doc.get("parallel", {})
    return JobShape(
        dp=int(par.get("data_parallel_size", 1)),
        tp=int(par.get("tensor_parallel_size", 1)),
        pp=int(par.get("pipeline_parallel_size", 1)),
        gpus_per_rank=int(par.get("gpus_per_rank", 1)),
    )


class FifoPolicy:
    """Strict first-in-first-out gang admission.

    Jobs go in arrival order; a job that does not fit blocks the ones behind it
    so a large job is never starved by a stream of small ones. Every job left
    waiting gets a reason.
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
            result = place(snap.nodes, used, job_shape(job))
            if isinstance(result, Infeasible):
                out.append(Wait(job.id, result.reason))
                blocked_by = job.id
                continue
            for slot in result.slots:
                used.setdefault(slot.node, set()).update(slot.gpus)
            out.append(Admit(job.id, result))
        return out


POLICIES: dict[str, type] = {"fifo": FifoPolicy}


def make_policy(name: str) -> AdmissionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"scheduler policy {name!r} is unknown; choose one of {sorted(POLICIES)}"
        ) from None
