"""The `checkpoint` section of a job spec: where checkpoints go (a shared folder, or
an object-store URL with an optional node-local staging folder), how often, how
many are kept, and whether saves run in the background.

Split from jobspec.py. Whether the URL's bucket exists and its credentials work
is asked at submission (platform/control/operations.py), not here: validation
needs no network.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kuangchao.platform.storage.objects import check_scheme
from kuangchao.platform.storage.urls import is_url


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


