"""The job lifecycle: one enum, one transition table, one transition function,
and the named operations every caller uses.

Every state change of every job goes through `transition`, which refuses the
changes the table forbids and returns the event that records the change. Callers
outside this module never name a target state: they apply an operation (`admit`,
`start`, `recover`, `resize`, `settle_resize`, `requeue`, `finish`, `fail`,
`cancel`) with `JobStore.update`, which commits the record, its event and the
active-set change in one step. An operation returns None where it does not apply
(the job already finished, or another path got there first), so that applying
it twice, or racing, is harmless; `tests/unit/test_architecture.py` checks that
no other module calls `transition`.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import Any

from kuangchao.platform.errors import InvalidTransition


class JobState(enum.StrEnum):
    """Lifecycle of a job.

    QUEUED: accepted and waiting for capacity (`waiting_for` says why).
    PLACING: capacity granted; placement group and workers are starting.
    RUNNING: every rank is training.
    RECOVERING: a rank failed; workers are being replaced and restored.
    RESIZING: the data-parallel degree is changing.
    SUCCEEDED: all steps done and the final checkpoint is on disk.
    FAILED: gave up; `message` carries the last error.
    CANCELLED: stopped on request; workers and placement group are gone.
    """

    QUEUED = "QUEUED"
    PLACING = "PLACING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    RESIZING = "RESIZING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL

    @property
    def holds_resources(self) -> bool:
        """Whether a job in this state occupies GPUs on the cluster."""
        return self in _ACTIVE


_TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
_ACTIVE = frozenset({JobState.PLACING, JobState.RUNNING, JobState.RECOVERING, JobState.RESIZING})

ALLOWED: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.PLACING, JobState.CANCELLED, JobState.FAILED}),
    JobState.PLACING: frozenset(
        {JobState.RUNNING, JobState.QUEUED, JobState.FAILED, JobState.CANCELLED, JobState.RECOVERING}
    ),
    JobState.RUNNING: frozenset(
        {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.RECOVERING,
         JobState.RESIZING, JobState.QUEUED}
    ),
    JobState.RECOVERING: frozenset(
        {JobState.PLACING, JobState.RUNNING, JobState.FAILED, JobState.CANCELLED, JobState.QUEUED,
         JobState.RESIZING}
    ),
    JobState.RESIZING: frozenset(
        {JobState.PLACING, JobState.RUNNING, JobState.FAILED, JobState.CANCELLED, JobState.RECOVERING,
         JobState.QUEUED, JobState.SUCCEEDED}
    ),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


@dataclass(frozen=True)
class PlacedRank:
    """Where one rank runs. `pid` and `gpu` are filled once the worker starts."""

    rank: int
    node: str
    node_id: str
    leaf: str
    gpu: int | None = None
    pid: int | None = None
    gpus: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["gpus"] = list(self.gpus)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PlacedRank:
        return cls(**{**d, "gpus": tuple(d.get("gpus") or ())})


@dataclass(frozen=True)
class JobRecord:
    """A job as stored in Redis. Immutable: changes produce a new record."""

    id: str
    name: str
    spec: dict[str, Any]
    state: JobState = JobState.QUEUED
    queue: str = "default"
    priority: int = 50
    world_size: int = 1
    gpus: int = 1
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    restarts: int = 0
    restart_log: tuple[dict[str, Any], ...] = ()
    preemptions: int = 0
    preempting_for: str | None = None
    placement: tuple[PlacedRank, ...] = ()
    # Elastic jobs: the data-parallel size now (0 until admitted), the size asked
    # for with `kc scale`, a resize the scheduler asked for and not yet done, and
    # the record of finished resizes.
    replicas: int = 0
    desired_replicas: int | None = None
    resize: dict[str, Any] | None = None
    resize_log: tuple[dict[str, Any], ...] = ()
    # A job whose survivors keep their work and lost a node: the replicas its
    # controller asks the scheduler to place elsewhere, and the scheduler's answer
    # (platform/execution/relocation.py has the exchange).
    relocate: dict[str, Any] | None = None
    waiting_for: str | None = None
    message: str | None = None
    driver: str = "scheduler"
    # Who submitted it (the API key's principal name) and for which tenant;
    # only that tenant's principals (and operators, admins) may see the job.
    owner: str | None = None
    tenant: str = "default"
    # When the job entered its current state (None for records written before
    # this field existed): queue waits and "stuck in RECOVERING" are read from it.
    state_since: float | None = None
    # `parallel: auto`: the planner's chosen layout and its predicted cost
    # (platform/planning/autoplan.py); None for a hand-written layout.
    plan: dict[str, Any] | None = None
    # `spare_workers`: the job's warm spares, one entry per node ({"node", "state":
    # warm | warming | failed, "standby"}), as its controller last saw them (spares.py).
    spares: tuple[dict[str, Any], ...] = ()
    version: int = 0

    def to_json(self) -> dict[str, Any]:
        # Field by field, not `dataclasses.asdict`: that deep-copies the spec,
        # which made it most of what a submit costs (bench/api.py). The values
        # are JSON-ready already, and records are never mutated in place.
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["state"] = self.state.value
        d["placement"] = [p.to_json() for p in self.placement]
        d["restart_log"], d["resize_log"] = list(self.restart_log), list(self.resize_log)
        d["spares"] = list(self.spares)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> JobRecord:
        d = dict(d)
        d["state"] = JobState(d["state"])
        d["restart_log"] = tuple(d.get("restart_log") or ())
        d["resize_log"] = tuple(d.get("resize_log") or ())
        d["spares"] = tuple(d.get("spares") or ())
        d["placement"] = tuple(
            PlacedRank.from_json(p) for p in d.get("placement") or ()
        )
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def transition(
    job: JobRecord, to: JobState, reason: str = "", now: float | None = None, **changes: Any
) -> tuple[JobRecord, dict[str, Any]]:
    """Move a job to a new state.

    Args:
        job: The current record.
        to: The target state.
        reason: Why, recorded in the event and, for FAILED, as `message`.
        now: Timestamp to record; defaults to the current time.
        **changes: Other record fields to set in the same step.

    Returns:
        The new record (version not yet bumped; the store does that on write)
        and the event describing the change.

    Raises:
        InvalidTransition: When the table does not allow `job.state -> to`.
    """
    if to not in ALLOWED[job.state]:
        raise InvalidTransition(
            f"job {job.id}: cannot go from {job.state.value} to {to.value}"
            + (" (it has already finished)" if job.state.is_terminal else "")
        )
    now = time.time() if now is None else now
    updates: dict[str, Any] = dict(changes)
    updates.setdefault("state_since", now)
    if to is JobState.RUNNING and job.started_at is None:
        updates.setdefault("started_at", now)
    if to.is_terminal:
        updates.setdefault("finished_at", now)
    if to is not JobState.QUEUED:
        updates.setdefault("waiting_for", None)
    if to in (JobState.FAILED, JobState.CANCELLED) or reason:
        updates.setdefault("message", reason or job.message)
    new = dataclasses.replace(job, state=to, **updates)
    event = {
        "ts": now,
        "type": "state",
        "from": job.state.value,
        "to": to.value,
        "message": reason,
    }
    return new, event


# -- named operations ---------------------------------------------------------------
# Each takes the current record and returns `transition`'s (record, event), or None
# when it does not apply; `JobStore.update(job_id, lambda j: op(j, ...))` commits it.
Change = tuple[JobRecord, dict[str, Any]] | None


def admit(job: JobRecord, reason: str, **changes: Any) -> Change:
    """QUEUED -> PLACING: capacity and a placement were granted (scheduler or `kc train`)."""
    if job.state is not JobState.QUEUED:
        return None
    return transition(job, JobState.PLACING, reason, **changes)


def start(job: JobRecord, reason: str, **changes: Any) -> Change:
    """-> RUNNING: every rank trains (placed, replaced in place, or restored after a rollback)."""
    if job.state is JobState.RUNNING or job.state.is_terminal:
        return None
    return transition(job, JobState.RUNNING, reason, **changes)


def resume_after_rollback(job: JobRecord, reason: str) -> Change:
    """RECOVERING -> RUNNING, for a numeric fault the ranks rolled back from themselves."""
    if job.state is not JobState.RECOVERING:
        return None
    return transition(job, JobState.RUNNING, reason)


def recover(job: JobRecord, reason: str, entry: dict[str, Any]) -> Change:
    """-> RECOVERING, counting one restart (`entry` joins `restart_log`).

    None when the job finished, or is RECOVERING already (another path counted it)."""
    if job.state.is_terminal or job.state is JobState.RECOVERING:
        return None
    return transition(job, JobState.RECOVERING, reason, restarts=job.restarts + 1,
                      restart_log=(*job.restart_log, entry))


def resize(job: JobRecord, reason: str, **changes: Any) -> Change:
    """RUNNING or RECOVERING -> RESIZING: the data-parallel size is changing."""
    if job.state not in (JobState.RUNNING, JobState.RECOVERING):
        return None
    return transition(job, JobState.RESIZING, reason, **changes)


def settle_resize(job: JobRecord, reason: str, **changes: Any) -> Change:
    """RESIZING -> RUNNING: the new generation formed, or the resize was called off."""
    if job.state is not JobState.RESIZING:
        return None
    return transition(job, JobState.RUNNING, reason, **changes)


def requeue(job: JobRecord, reason: str, *, only_from: JobState | None = None,
            **changes: Any) -> Change:
    """-> QUEUED, GPUs given back (preemption, or a recovery that needs a new placement).

    Args:
        only_from: Apply only when the job is in this state (e.g. RECOVERING)."""
    if job.state.is_terminal or (only_from is not None and job.state is not only_from):
        return None
    changes = {"placement": (), "preempting_for": None, "relocate": None, **changes}
    return transition(job, JobState.QUEUED, reason, **changes)


def finish(job: JobRecord, reason: str) -> Change:
    """-> SUCCEEDED: the last step is done and the final checkpoint verified."""
    if job.state.is_terminal:
        return None
    return transition(job, JobState.SUCCEEDED, reason)


def fail(job: JobRecord, reason: str) -> Change:
    """-> FAILED, with `reason` as the job's message."""
    if job.state.is_terminal:
        return None
    return transition(job, JobState.FAILED, reason)


def cancel(job: JobRecord, reason: str, *, only_queued: bool = False) -> Change:
    """-> CANCELLED; with `only_queued`, only a job that is still waiting."""
    if job.state.is_terminal or (only_queued and job.state is not JobState.QUEUED):
        return None
    return transition(job, JobState.CANCELLED, reason)
