"""Responses of `/v1/jobs`: a job (`platform/control/operations.job_view`), its
events, log lines, loss curve and sample record."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from kuangchao.api.server.schemas.common import Number, Passthrough, Public

JobStateName = Literal["QUEUED", "PLACING", "RUNNING", "RECOVERING", "RESIZING", "SUCCEEDED",
                       "FAILED", "CANCELLED"]


class PlacementPublic(Public):
    """Where one rank runs (`PlacedRank`); `gpu` and `pid` are filled once it starts."""

    rank: int
    node: str
    node_id: str
    leaf: str
    gpu: int | None
    pid: int | None
    gpus: list[int]


class SparePublic(Public):
    """One warm spare of a job (platform/execution/spares.py)."""

    node: str
    state: Literal["warm", "warming", "failed"] = Field(
        description="warm: ready to adopt a rank; warming: still importing; failed: it did not start")
    standby: bool = Field(description="on a node the job does not use (`standby_spares`)")


class RoutingPublic(Public):
    """A mixture of experts' routing at the last logged step (platform/observability/routing.py)."""

    expert_load: list[Number] = Field(description="token-expert assignments per expert, over every "
                                                   "rank, before capacity")
    dropped_tokens: Number = Field(description="assignments over expert capacity, dropped")
    aux_loss: Number = Field(description="the load-balancing loss, before model.aux_loss_coef (1: even)")
    z_loss: Number = Field(description="the router z-loss, before model.z_loss_coef")
    imbalance: Number | None = Field(description="the busiest expert's load over the mean (1: even)")


class ProgressPublic(Public):
    """Rank 0's last report; zeros and nulls for a job that never started."""

    step: int
    total_steps: int | None
    loss: Number | None
    initial_loss: Number | None
    tokens_per_s: Number | None
    lr: Number | None = Field(None, description="the learning rate of the last logged step")
    mem_bytes: Number | None = Field(None, description="rank 0's memory: GPU allocated, else resident")
    comm_share: Number | None = Field(None, description="share of rank 0's last step spent communicating")
    eval_loss: Number | None = Field(None, description="the loss on the held-out split "
                                                      "(data.eval_fraction), at the last evaluation")
    moe: RoutingPublic | None = Field(None, description="a mixture of experts' routing at the last "
                                                        "logged step; null for a dense model")


class CheckpointPublic(Passthrough):
    """A committed checkpoint, as the rank that wrote it listed it
    (`platform/protocol/checkpoint.CheckpointInfo` plus `committed_at`). The ranks
    own this record, so keys added there pass through."""

    step: int
    path: str
    bytes: int | None = Field(None, description="its size on disk, every shard together")
    blocked_s: Number | None = Field(None, description="how long training waited to stage it")
    write_s: Number | None = Field(None, description="how long the write took, in the background")
    committed_at: Number | None = None


class GoodputPublic(Public):
    """Where the job's wall-clock time went (platform/observability/goodput.py): productive
    time plus `by_cause` adds up to `wall_s`. Null numbers, with `reason`, when the
    job's records could not be split."""

    wall_s: Number | None = Field(description="from submit to the end, or to `as_of` while live")
    ettr: Number | None = Field(description="effective training time ratio: productive_s / wall_s")
    productive_s: Number | None = Field(description="time on training steps that are kept")
    by_cause: dict[str, Number | None] = Field(
        description="seconds by cause: startup, checkpoint, detection, recovery, redone, "
                    "queueing, preemption, other")
    lost_s: Number | None = Field(description="every cause together: wall_s - productive_s")
    since: Number = Field(description="the job's creation")
    as_of: Number | None = Field(description="the end of the split: the job's end, or now")
    live: bool
    open_cause: str | None = Field(description="what the time from now on counts as, while live "
                                               "(`productive` while training)")
    reason: str | None = Field(description="why part of the split is uncertain, or missing")


class GoodputTotal(Public):
    """Several jobs' splits summed; `ettr` is weighted by each job's wall-clock time."""

    jobs: int
    wall_s: Number
    productive_s: Number
    ettr: Number | None
    by_cause: dict[str, Number]


class GoodputJob(Public):
    id: str
    name: str
    state: JobStateName
    wall_s: Number
    ettr: Number | None
    lost_s: Number


class ClusterGoodput(Public):
    """`GET /v1/goodput`: the caller's newest jobs, summed (active and finished apart)."""

    all: GoodputTotal
    active: GoodputTotal
    finished: GoodputTotal
    jobs: list[GoodputJob] = Field(description="each job counted, oldest first")


class JobPublic(Public):
    """A job: its stored record (`JobRecord`, less its version) and what the
    view adds: progress, elastic range, checkpoints and queue position."""

    id: str
    name: str
    # The spec as validated at submit time. A record outlives releases, so an old
    # job's spec is not re-validated against today's JobSpec: an open document.
    spec: dict[str, Any]
    state: JobStateName
    queue: str
    priority: int
    world_size: int
    gpus: int
    created_at: Number
    started_at: Number | None
    finished_at: Number | None
    restarts: int
    # One free-form entry per restart or resize, written by the controller.
    restart_log: list[dict[str, Any]]
    preemptions: int
    preempting_for: str | None
    placement: list[PlacementPublic]
    replicas: int
    desired_replicas: int | None
    resize: dict[str, Any] | None
    resize_log: list[dict[str, Any]]
    # A node lost under a job whose survivors keep their work: the replicas its
    # controller asked the scheduler to place elsewhere, and the answer.
    relocate: dict[str, Any] | None = None
    waiting_for: str | None
    message: str | None = Field(description="the last state change's reason; for FAILED, "
                                            "the error")
    driver: str
    owner: str | None
    tenant: str
    state_since: Number | None
    # The planner's chosen layout and predicted cost (platform/planning/autoplan.py).
    plan: dict[str, Any] | None
    spares: list[SparePublic] = Field(default_factory=list, description="with "
                                      "`fault_tolerance.spare_workers`: the job's warm spares")
    progress: ProgressPublic
    min_replicas: int
    max_replicas: int
    global_batch: int
    samples_seen: int
    measured_step_s: Number | None
    checkpoints: list[CheckpointPublic]
    queue_position: int | None = Field(description="1-based place in the queue while QUEUED")
    goodput: GoodputPublic | None = Field(None, description="only on `GET /v1/jobs/{id}`")


class JobList(Public):
    jobs: list[JobPublic] = Field(description="the page's jobs, oldest first")
    next_cursor: str | None = Field(None, description="pass as `cursor` for the jobs just "
                                    "older than this page; null: there are none")


class DryRunPublic(Public):
    """`POST /v1/jobs?dry_run=true`: the spec as it would be queued."""

    valid: Literal[True]
    spec: dict[str, Any]  # the validated JobSpec's JSON: the request's document, completed
    plan: dict[str, Any] | None


class SamplesPublic(Public):
    record_samples: bool
    samples: dict[str, str] = Field(description="`step/dp_rank/micro` -> the sample range")


class EventPublic(Passthrough):
    """One entry of a job's timeline. Each `type` (state, placement, failure,
    resize, ...) carries its own keys, written across the control plane and the
    ranks: those pass through as they were recorded."""

    ts: Number
    type: str
    message: str | None = None
    reason: str | None = Field(None, description="why, for the types that say (rollback, ...)")


class EventList(Public):
    events: list[EventPublic]
    next: int = Field(description="the `start` of the next call")


class LogLinePublic(Passthrough):
    """One line a rank logged (`workers/runtime/joblog.py`); a line may carry
    fields of its own, which pass through."""

    ts: Number | None = None
    level: str | None = Field(None, description="INFO, WARNING or ERROR")
    job_id: str | None = None
    rank: int | None = Field(None, description="the rank that logged it; none for the controller")
    module: str | None = Field(None, description="the part of the rank that logged it")
    message: str | None = None


class LogList(Public):
    logs: list[LogLinePublic]
    next: int = Field(description="the `start` of the next call, filters or not")


class MetricPointPublic(Passthrough):
    """One logged step of the loss curve; the trainer may log more than these."""

    step: int
    ts: Number | None = None
    loss: Number | None = Field(None, description="the global batch's mean loss at this step")
    tokens_per_s: Number | None = None
    step_s: Number | None = Field(None, description="the wall time of this one step")
    eval_loss: Number | None = Field(None, description="the held-out split's loss, at evaluated steps")


class MetricPointList(Public):
    points: list[MetricPointPublic]
    next: int = Field(description="the `start` of the next call")
