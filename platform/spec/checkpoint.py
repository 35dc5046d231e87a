"""The `checkpoint` section of a job spec: where checkpoints go (a shared folder, or
an object-store URL with an optional node-local staging folder), how often, how
many are kept, whether saves run in the background, and the optional copies
kept in peers' memory (`in_memory`).

Split from jobspec.py. Whether the URL's bucket exists and its credentials work
is asked at submission (platform/control/operations.py), not here: validation
needs no network.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kuangchao.platform.storage.objects import check_scheme
from kuangchao.platform.storage.urls import is_url

# The most one rank's copy may be bound to: 1 TiB, far above any host's memory, so
# that only a typo (a size in bytes, say) is refused here.
MAX_MB_PER_RANK = 1 << 20
MAX_REPLICAS = 8


class InMemorySection(BaseModel):
    """`checkpoint.in_memory`: each rank's newest state kept in host memory, by a keeper
    on its own node and on `replicas` keepers on other nodes, every `interval_steps`
    steps (docs/fault-tolerance.md, "Peer-memory checkpoints").

    `max_mb_per_rank` bounds one copy of one rank's state (model and optimizer shard,
    RNG and data position, serialized). A copy over it is refused: the rank logs a
    warning and the job relies on its disk checkpoints. A keeper holds at most the two
    newest copies of each rank it keeps (two, so that a failure in the middle of a
    push still leaves a step every rank has), so what one keeper holds is at most
    2 x max_mb_per_rank x the ranks whose copies it keeps, and what the job holds
    at most 2 x max_mb_per_rank x (1 + replicas) x its ranks.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    interval_steps: int = Field(ge=1)
    replicas: int = Field(1, ge=1, le=MAX_REPLICAS)
    max_mb_per_rank: int = Field(ge=1, le=MAX_MB_PER_RANK)

    @property
    def max_bytes_per_rank(self) -> int:
        return self.max_mb_per_rank * 1024 * 1024


class CheckpointSection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)  # as every section: typos fail

    interval_steps: int = Field(50, ge=1)
    # A folder every node shares, or an object-store URL (s3://bucket/prefix, any fsspec URL).
    path: str = Field("checkpoints", min_length=1, max_length=1024)
    keep_last: int = Field(3, ge=1)
    # Periodic checkpoints block training only while the state is copied to CPU memory.
    async_save: bool = True
    # With an object-store path: a folder on each node's own disk that saves land in
    # first (uploaded in the background) and that restores on that node read from.
    local_staging: str | None = Field(None, min_length=1, max_length=1024)
    # Copies of each rank's newest state in peers' memory (InMemorySection); None: off.
    in_memory: InMemorySection | None = None

    @field_validator("path")
    @classmethod
    def _known_store(cls, path: str) -> str:
        if is_url(path):
            problem = check_scheme(path)
            if problem is not None:
                raise ValueError(problem)
            if any(c in path for c in "*?["):
                raise ValueError("a checkpoint URL is one prefix: no wildcards (*, ?, [)")
        elif "://" in path:  # file:// and local://: a plain path says the same
            raise ValueError(f"{path!r}: write a local folder as a plain path, without a scheme")
        return path

    @field_validator("local_staging")
    @classmethod
    def _staging(cls, staging: str | None, info: Any) -> str | None:
        if staging is None:
            return None
        if is_url(staging) or "://" in staging:
            raise ValueError("must be a folder on each node's own disk, not a URL")
        if not staging.startswith(("/", "~")) and ".." in staging.split("/"):
            raise ValueError("a relative staging folder lies under each node's own folder; "
                             "it may not climb out of it with '..'")
        if not is_url(info.data.get("path") or ""):
            raise ValueError("only an object-store checkpoint.path (s3://…) is staged; with a "
                             "folder path, drop local_staging")
        return staging


