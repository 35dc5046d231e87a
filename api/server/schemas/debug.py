"""Responses of `/v1/jobs/{id}/debug/{kind}` and `/v1/jobs/{id}/profiles`
(platform/jobs/debugreq.py builds the reports)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from kuangchao.api.server.schemas.common import Number, Public

# What each rank answered, as it sent it: the keys are the rank's own diagnosis
# (groups, pending collective, memory stats, profiler summary), keyed by rank.
RankAnswers = dict[int, dict[str, Any]]


class _Asked(Public):
    job: str
    kind: str  # each report narrows it to its own; the field keeps this place
    request: str = Field(description="the debug request's id")
    missing: list[int] = Field(description="ranks that did not answer in time")


class SlowLink(Public):
    """A node the job's newest link probe measured at under half the best node's rate."""

    node: str
    gbps: Number | None = Field(description="its rate to the control plane's Redis, Gbit/s")
    best_gbps: Number | None = Field(description="the best node's rate in the same probe")
    at: Number | None = Field(description="when the probe ran (Unix time)")


class CommReport(_Asked):
    kind: Literal["comm"]
    ranks: RankAnswers
    problems: list[str] = Field(description="groups the ranks disagree on, and ranks stuck "
                                            "in different collectives")
    healthy: bool
    slow_links: list[SlowLink] | None = Field(None, description=(
        "nodes the job's last link probe found slow (a straggler); each rank's own view of "
        "the probe is its `links`"))


class MemoryReport(_Asked):
    kind: Literal["memory"]
    ranks: RankAnswers


class DivergedParam(Public):
    """A parameter whose gradient differs across replicas. Norms are the ranks'
    own floats: one that is not finite (or a rank lacking the parameter, an
    infinite divergence) is sent as null."""

    param: str
    divergence: Number | None
    rank: int
    norm_rank0: Number | None
    norm_rank: Number | None


class GradientReport(_Asked):
    kind: Literal["gradient"]
    ranks: int = Field(description="how many ranks answered")
    step: int | None
    steps_agree: bool | None = Field(None, description="absent when no rank answered")
    params: int | None = Field(None, description="absent when no rank answered")
    max_divergence: Number | None
    identical: bool
    diverged: list[DivergedParam]
    errors: dict[int, str] = Field(description="ranks that could not compute their digest")


DebugReport = Annotated[CommReport | MemoryReport | GradientReport, Field(discriminator="kind")]


class ProfileStarted(Public):
    job: str
    id: str = Field(description="the profile's id, for GET .../profiles/{id}")
    steps: int
    ranks: int


class ProfileStatus(Public):
    job: str
    id: str
    ranks: RankAnswers
    missing: list[int]
    done: bool
    files: list[str] = Field(description="the traces to download, one per rank that wrote one")
