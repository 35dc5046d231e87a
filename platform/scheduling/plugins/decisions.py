"""The frozen decisions a scheduling cycle returns, and the one it keeps to itself."""

from __future__ import annotations

from dataclasses import dataclass, field

from kuangchao.platform.placement.solver import PlacementPlan

GpuMap = dict[str, set[int]]


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
    pool: str | None = None  # the GPU pool (type) a one-type job waits for, on a mixed cluster


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


@dataclass(frozen=True)
class Relocate:
    """Place a running job's replicas that lost their node elsewhere, at the same size
    (its survivors keep their work), or say why not (`plan` None)."""

    job_id: str
    requested_at: float  # the request it answers: a newer one is not answered by this
    reason: str
    plan: PlacementPlan | None = None


Decision = Admit | Wait | Preempt | Resize | Relocate


@dataclass(frozen=True)
class Hold:
    """Reserve GPUs for the rest of the cycle; `head` names the blocked head job it is for.

    Internal to a cycle: the composition records it in the ledger and never
    returns it to the scheduler.
    """

    gpus: GpuMap = field(default_factory=dict)
    head: str | None = None


Step = Decision | Hold
