"""Responses of `/v1/nodes`, `/v1/queues`, `/v1/metrics/targets` and `/healthz`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

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


class NodeOverrides(Public):
    """An operator's override of a node's GPU type and emulated speed; an absent key
    is not overridden."""

    gpu_type: str | None = None
    emulated_speed: Number | None = None


class NodePublic(Passthrough):
    """One node: the registry's entry (`NodeInfo.to_json`) and the GPUs active
    jobs hold on it. The entry is the registry's document, stored as it wrote
    it (an older registry wrote fewer keys), so its keys pass through."""

    name: str
    node_id: str | None = None
    gpus: int
    nvlink: list[list[int]] | None = None
    leaf: str | None = None
    leaf_measured: bool | None = Field(None, description="true: `leaf` was found by `kc topology "
                                                         "probe`, the node has no kc.io/leaf label")
    spine: str | None = None
    cpus: Number | None = None
    alive: bool | None = None
    pinned_gpus: bool | None = None
    accelerator: str | None = Field(None, description="the GPU model Ray detected; null: none "
                                                      "or fake GPUs")
    gpu_type: str | None = Field(None, description="the GPUs' catalogue type (h100-80gb): the "
                                                   "operator's override, else the node's label, "
                                                   "else Ray's detection; null: unknown")
    emulated_speed: Number | None = Field(None, description="fake clusters only: the fraction "
                                                            "of full speed its ranks run at")
    problems: list[str] | None = Field(None, description="what the registry ignored on this "
                                                         "node, and why")
    used_gpus: list[int]
    free_gpus: int
    jobs: list[str]
    gpu_map: list[GpuSlot]
    quarantine: QuarantinePublic | None
    overrides: NodeOverrides | None = Field(None, description="what `kc node set` stored")


class NodeList(Public):
    nodes: list[NodePublic]
    updated_at: Number | None = Field(description="when the registry last wrote its view")


class NodeSet(BaseModel):
    """`PATCH /v1/nodes/{name}`: either field or both; null clears that override
    (the node goes back to its label or the type Ray detected)."""

    model_config = ConfigDict(extra="forbid")

    gpu_type: str | None = Field(None, description="a catalogue type, e.g. h100-80gb")
    emulated_speed: float | None = Field(None, strict=True, description=(
        "fake clusters only: in (0, 1], the fraction of full speed the node's ranks run at"))


class NodeOverridden(Public):
    node: str
    overrides: NodeOverrides = Field(description="the node's overrides now; the registry "
                                                 "applies them within a scheduling cycle")


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
    gpu_types: dict[str, int] | None = Field(None, description="GPUs it may hold of each type "
                                                               "listed; null: no per-type limit")


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
