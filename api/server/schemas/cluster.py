"""Responses of `/v1/nodes`, `/v1/queues`, `/v1/metrics/targets` and `/healthz`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kuangchao.api.server.schemas.common import Number, Passthrough, Public


class GpuSlot(Public):
    """Who holds one GPU; a job of a tenant the caller may not see shows as `hidden`."""

    gpu: int
    job: str | None
    rank: int | None
    hidden: bool


class QuarantinePublic(Passthrough):
    """A node's active quarantine entry, as the failure handler recorded it
    (platform/execution/recovery.py); the handler owns its keys."""

    since: Number | None = None
    until: Number
    failures: int | None = None
    reason: str | None = None
    node_id: str | None = None


class NodePublic(Passthrough):
    """One node: the registry's entry (`NodeInfo.to_json`) and the GPUs active
    jobs hold on it. The entry is the registry's document, stored as it wrote
    it (an older registry wrote fewer keys), so its keys pass through."""

    name: str
    node_id: str | None = None
    gpus: int
    nvlink: list[list[int]] | None = None
    leaf: str | None = None
    spine: str | None = None
    cpus: Number | None = None
    alive: bool | None = None
    pinned_gpus: bool | None = None
    accelerator: str | None = None
    used_gpus: list[int]
    free_gpus: int
    jobs: list[str]
    gpu_map: list[GpuSlot]
    quarantine: QuarantinePublic | None


class NodeList(Public):
    nodes: list[NodePublic]
    updated_at: Number | None = Field(description="when the registry last wrote its view")


class NodeReleased(Public):
    node: str
    released: Literal[True]


class QueuePublic(Public):
    name: str
    guaranteed_gpus: int
    borrow_limit_gpus: int | None
    limit_gpus: int | None = Field(description="guaranteed plus borrow limit; null: no limit")
    gpus_in_use: int
    running: int
    queued: int
    tenants: list[str] | None = Field(None, description="the tenants whose jobs it takes; "
                                                        "null: every tenant's")


class RoleLimitsPublic(Public):
    max_priority: int
    max_restarts: int
    max_data_bytes: int


class QueueList(Public):
    queues: list[QueuePublic]
    preemption: bool
    policy: str
    limits: dict[str, RoleLimitsPublic] = Field(
        default_factory=dict, description="per role, the most a job it submits may ask for")


class ScrapeLabels(Public):
    job: str
    rank: str
    node: str


class ScrapeGroup(Public):
    """One rank's metrics endpoint, as a Prometheus HTTP service discovery group."""

    targets: list[str]
    labels: ScrapeLabels


class Health(Public):
    status: Literal["ok"]
    version: str
