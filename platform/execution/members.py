"""The worker group's records of its ranks, and how a rank's `run` ended.

Plain data, with no Ray in them, so that the controller's unit tests build
the same `Outcome`s a fake worker group returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Member:
    """One rank: its actor, its bundle, the GPUs planned for it, what it reported."""

    actor: Any
    bundle: dict[str, float]
    planned: tuple[int, ...] | None
    info: dict[str, Any] = field(default_factory=dict)
    ref: Any = None  # its running `run` call


@dataclass(frozen=True)
class GroupSnapshot:
    """The group before a resize, to go back to when it is called off."""

    members: tuple[Member, ...]
    pgs: tuple[Any, ...]


@dataclass(frozen=True)
class Outcome:
    """How one rank's `run` ended: a value, the train function's error, or a death."""

    rank: int
    value: Any = None
    error: str | None = None
    died: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.died is None
