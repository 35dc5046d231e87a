"""The plugin interfaces: each a Protocol, each pure, each answering with frozen decisions.

A gang-policy cycle asks them in this order for every queued job (highest
priority first, then arrival), stopping at the first that answers: `Quota`,
`Preemption.pending`, `Admission`, `Shrink.make_room`, `Preemption.evict`,
`Backfill`; then, for every running job, `Shrink.requested` and `Grow`.
Plugins read the cycle's ledger and never write it; the composition applies
each decision they return.
"""

from __future__ import annotations

from typing import Protocol

from kuangchao.platform.placement.solver import Infeasible, JobShape
from kuangchao.platform.scheduling.plugins.cycle import Cycle
from kuangchao.platform.scheduling.plugins.decisions import Admit, Decision, Resize, Step, Wait
from kuangchao.platform.scheduling.plugins.quota import Sizes
from kuangchao.platform.scheduling.plugins.snapshot import JobView, Snapshot


class AdmissionPolicy(Protocol):
    """A whole policy: a snapshot in, the cycle's decisions out."""

    name: str

    def decide(self, snap: Snapshot) -> list[Decision]: ...


class Quota(Protocol):
    def admissible(self, job: JobView, cycle: Cycle) -> Sizes | Wait:
        """The sizes `job` may take within its quota, or why it waits."""
        ...

    def room(self, queue_name: str, gpus: int, cycle: Cycle) -> bool:
        """Whether the queue may take `gpus` more GPUs."""
        ...


class Admission(Protocol):
    def place(self, job: JobView, sized: Sizes, cycle: Cycle) -> Admit | Infeasible:
        """An admission at one of `sized`, or why none fits now."""
        ...


class Preemption(Protocol):
    def pending(self, job: JobView, cycle: Cycle) -> tuple[Step, ...]:
        """The wait of a job whose victims are on their way out; empty otherwise."""
        ...

    def evict(self, job: JobView, shape: JobShape, need: int, cycle: Cycle) -> tuple[Step, ...]:
        """Evictions that make room for `job` at `shape`, then its wait; empty when none."""
        ...


class Shrink(Protocol):
    def make_room(self, job: JobView, shape: JobShape, need: int,
                  cycle: Cycle) -> tuple[Step, ...]:
        """Shrinks that make room for `job` at `shape`, then its wait; empty when none."""
        ...

    def requested(self, job: JobView) -> Resize | None:
        """The shrink a running job's user asked for, if any."""
        ...


class Grow(Protocol):
    def grow(self, job: JobView, cycle: Cycle) -> Resize | None:
        """A grow of a running elastic job into free GPUs, if one fits."""
        ...


class Backfill(Protocol):
    def wait(self, job: JobView, shape: JobShape, need: int, reason: str,
             cycle: Cycle) -> tuple[Step, ...]:
        """How a job that fits nowhere waits, and what it holds meanwhile."""
        ...
