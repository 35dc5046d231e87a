"""Finished jobs leave Redis once their retention is over (`KC_JOB_RETENTION_DAYS`).

Every job leaves its record, events, logs, loss curve and metrics in Redis, and
Redis runs with `maxmemory` and `noeviction` (docs/operator-guide.md, "Redis
sizing"): a history that only grows ends with Redis refusing writes, running
jobs' included. So the scheduler, a minute after it starts and then every
`SWEEP_S`, forgets the jobs that finished (SUCCEEDED, FAILED or CANCELLED) more
than the retention ago: their record, their place in the index and their keys
go, in one script per job that checks again that the job is finished and old
enough (platform/jobs/retention_store.py). Each purge is audited.

Not touched: the audit trail (its stream is capped, and its file outlives
Redis), checkpoints (the user's data, in the checkpoint folder or bucket, kept as
the spec's `checkpoint.keep_last` says), and what Prometheus already scraped. A
retention of 0 keeps every job forever.

Pure of Ray and Redis: the store, the audit trail and the clocks are injected.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kuangchao.platform.jobs.encoding import PURGED, STALE
from kuangchao.platform.jobs.state import JobRecord, JobState
from kuangchao.platform.security.audit import AuditRecord

log = logging.getLogger(__name__)

SWEEP_S = 600.0  # a day's retention is judged to within ten minutes
FIRST_SWEEP_S = 60.0  # not at start-up: the first scheduling cycles come first
PAGE = 500  # index entries read per round trip
MAX_PER_SWEEP = 2_000  # deletions per sweep; a backlog (a first sweep) takes a few sweeps
TERMINAL = tuple(s.value for s in JobState if s.is_terminal)
PRINCIPAL = "kc-scheduler"
DAY_S = 86_400.0


def expired(job: JobRecord, cutoff: float) -> bool:
    """Whether `job` finished before `cutoff` (a wall-clock time)."""
    return job.state.is_terminal and job.finished_at is not None and job.finished_at < cutoff


class RetentionSweep:
    """Deletes the jobs that finished more than `days` ago, a bounded batch per sweep.

    Args:
        store: The job store (`jobs_before`, `purge_finished`).
        days: The retention; 0 keeps every job.
        trail: The audit trail each purge is recorded in (`AuditLog`), or None for
            the log alone (tests).
    """

    def __init__(self, store: Any, days: float, trail: Any = None,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.store, self.days, self.trail = store, days, trail
        self.clock, self.monotonic = clock, monotonic
        self.purged_total = 0
        self._next = monotonic() + FIRST_SWEEP_S

    def due(self) -> bool:
        """Whether a sweep is due (the first `FIRST_SWEEP_S` after start, then every `SWEEP_S`)."""
        return self.days > 0 and self.monotonic() >= self._next

    def sweep(self) -> list[str]:
        """One sweep; returns the ids of the jobs it deleted, oldest-created last."""
        self._next = self.monotonic() + SWEEP_S
        if self.days <= 0:
            return []
        cutoff = self.clock() - self.days * DAY_S
        purged: list[str] = []
        # Only a job created before the cutoff can have finished before it: walk the index
        # back from there, newest first.
        pos: tuple[float, str] | None = (cutoff, "")
        while pos is not None and len(purged) < MAX_PER_SWEEP:
            page = self.store.jobs_before(pos, PAGE)
            for _created, job_id, job in page:
                if len(purged) >= MAX_PER_SWEEP:
                    break
                if job is not None and not expired(job, cutoff):
                    continue
                outcome = self.store.purge_finished(job_id, cutoff, TERMINAL)
                if outcome == PURGED:
                    purged.append(job_id)
                    self._audit(job_id, job)
                elif outcome == STALE:
                    log.info("retention: dropped index entry %s, whose record was gone", job_id)
            pos = (page[-1][0], page[-1][1]) if len(page) == PAGE else None
        if purged:
            self.purged_total += len(purged)
            log.info("retention: forgot %d job(s) finished over %g day(s) ago", len(purged),
                     self.days)
        return purged

    def _audit(self, job_id: str, job: JobRecord | None) -> None:
        if self.trail is None:
            return
        state = job.state.value if job else "?"
        finished = (time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(job.finished_at))
                    if job and job.finished_at else "?")
        # Not `job=`: the job's own audit copy is found through its record, now gone.
        self.trail.record(AuditRecord(
            principal=PRINCIPAL, action="job.purge", resource=f"job/{job_id}", decision="allow",
            reason=f"{state} at {finished}, past the retention of {self.days:g} day(s) "
                   "(KC_JOB_RETENTION_DAYS): its record, events, logs and metrics left Redis"))
