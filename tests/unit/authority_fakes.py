"""A token authority over an in-memory store, with one live job, for the unit
tests of minting, renewal and roles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kuangchao.platform.jobs.memory import MemoryStore
from kuangchao.platform.jobs.state import JobRecord, JobState
from kuangchao.platform.security.audit import AuditLog
from kuangchao.platform.security.authority import TokenAuthority
from kuangchao.platform.security.tokens import generate_key


def live_authority(tmp_path: Path, spec: dict[str, Any], job_id: str = "job-a") -> TokenAuthority:
    """An authority with a fresh key and job `job_id` RUNNING with `spec`."""
    store = MemoryStore()
    store.create(JobRecord(id=job_id, name="a", spec=spec, state=JobState.RUNNING))
    return TokenAuthority(store, generate_key(), AuditLog(store, tmp_path / "audit.jsonl"),
                          admin_url=None, job_acl=False)
