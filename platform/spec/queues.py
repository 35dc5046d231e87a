"""Queues and GPU quotas.

Each queue has a guaranteed share (`guaranteed_gpus`), always available to it,
and may borrow idle GPUs beyond that up to `borrow_limit_gpus` more (no limit
when unset). Borrowed GPUs can be taken back: a job whose queue is below its
guarantee may preempt jobs of queues that are above theirs. Queues come from a
YAML file (`kc up --queues queues.yaml`); without one there is a single queue
`default` with no limit.

    queues:
      - {name: team-a, guaranteed_gpus: 8, borrow_limit_gpus: 8, tenants: [vision]}
      - {name: team-b, guaranteed_gpus: 8, gpu_types: {h100-80gb: 4}}
    preemption: true
    limits:                     # per role; a role not named keeps its defaults
      submitter: {max_priority: 100, max_restarts: 20, max_data_bytes: 1073741824}

A queue with `tenants` takes only those tenants' jobs. A queue with `gpu_types`
holds at most that many GPUs of each type named (catalogue keys), on top of its
overall limit; types it does not name are limited by the overall limit alone.
What `limits` bounds, and its defaults, are in platform/security/admission.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kuangchao.platform.cluster.hardware import CATALOG
from kuangchao.platform.errors import SpecError
from kuangchao.platform.spec.jobspec import pydantic_errors, read_yaml_mapping

DEFAULT_QUEUE = "default"


class QueueModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    guaranteed_gpus: int = Field(0, ge=0)
    borrow_limit_gpus: int | None = Field(None, ge=0)
    # Only these tenants' jobs (unset: every tenant's).
    tenants: list[Annotated[str, Field(min_length=1, max_length=128)]] | None = Field(
        None, max_length=1000)
    # The most GPUs of each named type the queue may hold at once (borrowing included).
    gpu_types: dict[str, Annotated[int, Field(ge=0)]] | None = Field(None, max_length=64)

    @field_validator("gpu_types")
    @classmethod
    def _known_types(cls, v: dict[str, int] | None) -> dict[str, int] | None:
        if v is None:
            return None
        out: dict[str, int] = {}
        for name, gpus in v.items():
            key = name.strip().lower()
            if key == "cpu" or key not in CATALOG:
                known = ", ".join(sorted(k for k in CATALOG if k != "cpu"))
                raise ValueError(f"{name!r} is not a GPU type in the catalogue; per-type "
                                 f"limits take one of {known}, e.g. {{h100-80gb: 8}}")
            if key in out:
                raise ValueError(f"GPU type {key!r} is given twice")
            out[key] = gpus
        return out


class RoleLimitsModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_priority: int | None = Field(None, ge=0, le=10**9)
    max_restarts: int | None = Field(None, ge=0, le=10_000)
    max_data_bytes: int | None = Field(None, ge=0, le=1 << 50)


class QueueFileModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    queues: list[QueueModel] = Field(min_length=1)
    preemption: bool = True
    policy: str = "gang"
    limits: dict[Literal["viewer", "submitter", "operator", "admin"], RoleLimitsModel] = {}

    @field_validator("queues")
    @classmethod
    def _unique(cls, v: list[QueueModel]) -> list[QueueModel]:
        names = [q.name for q in v]
        if len(set(names)) != len(names):
            raise ValueError(f"queue names must be unique, got {names}")
        return v


@dataclass(frozen=True)
class Queue:
    name: str
    guaranteed_gpus: int = 0
    borrow_limit_gpus: int | None = None
    tenants: tuple[str, ...] | None = None
    gpu_types: Mapping[str, int] = field(default_factory=dict)  # per-type limits, if any

    @property
    def limit(self) -> float:
        """The most GPUs this queue may hold, borrowing included."""
        if self.borrow_limit_gpus is None:
            return float("inf")
        return self.guaranteed_gpus + self.borrow_limit_gpus

    def type_room(self, in_use: Mapping[str, int]) -> dict[str, int]:
        """GPUs of each limited type it may still take, given what it holds per type."""
        return {t: max(0, cap - in_use.get(t, 0)) for t, cap in self.gpu_types.items()}


@dataclass(frozen=True)
class QueueTable:
    queues: tuple[Queue, ...] = field(default_factory=lambda: (Queue(DEFAULT_QUEUE),))
    preemption: bool = True
    policy: str = "gang"
    limits: dict[str, dict[str, int]] = field(default_factory=dict)  # role -> ceilings set

    def get(self, name: str) -> Queue | None:
        return next((q for q in self.queues if q.name == name), None)

    @property
    def names(self) -> list[str]:
        return [q.name for q in self.queues]

    def to_json(self) -> dict[str, Any]:
        # `tenants` and `limits` only where set: tables stored before they existed
        # read back the same, and so do their answers.
        out: dict[str, Any] = {
            "queues": [{k: v for k, v in q.__dict__.items() if k not in ("tenants", "gpu_types")}
                       | ({"tenants": list(q.tenants)} if q.tenants is not None else {})
                       | ({"gpu_types": dict(q.gpu_types)} if q.gpu_types else {})
                       for q in self.queues],
            "preemption": self.preemption, "policy": self.policy}
        if self.limits:
            out["limits"] = self.limits
        return out

    @classmethod
    def from_json(cls, doc: dict[str, Any] | None) -> QueueTable:
        if not doc:
            return cls()
        return cls(queues=tuple(Queue(**{**q, "tenants": tuple(q["tenants"])} if "tenants" in q
                                      else q) for q in doc["queues"]),
                   preemption=doc.get("preemption", True), policy=doc.get("policy", "gang"),
                   limits=doc.get("limits") or {})


def parse_queues(doc: Any, source: str = "queues") -> QueueTable:
    """Validate a queue document. Raises `SpecError` with one entry per problem."""
    try:
        model = QueueFileModel.model_validate(doc)
    except ValidationError as exc:
        raise SpecError(pydantic_errors(exc, prefix=f"{source}: ")) from None
    return QueueTable(
        queues=tuple(Queue(q.name, q.guaranteed_gpus, q.borrow_limit_gpus,
                           None if q.tenants is None else tuple(q.tenants), q.gpu_types or {})
                     for q in model.queues),
        preemption=model.preemption, policy=model.policy,
        limits={role: m.model_dump(exclude_none=True) for role, m in model.limits.items()})


def load_queues(path: str | Path) -> QueueTable:
    return parse_queues(read_yaml_mapping(Path(path), "queue file"), str(path))
