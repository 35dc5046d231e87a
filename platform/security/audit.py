"""The audit trail: one structured record per allow or deny of a privileged action.

Every record says when, who (a principal, or a module id from a token), what
action on which resource, the decision and why. Records go to a Redis stream
(capped, newest kept) for `kc audit` and `GET /v1/audit`, and to a JSONL file
that outlives Redis. A record that cannot reach one sink still reaches the
other; a failure to audit is logged, never silently dropped.

A record about a job (`job` set) whose spec names `permission.audit_log` is
also appended there, the same JSON line, by the trusted processes that keep
the trail (the API, the token authority, a `kc train` driver: each passes the
audit roots), never by a rank (platform/security/job_audit.py: under the audit
roots, checked again at each write, no symlinks followed). That copy is
written after the main trail, and a failure to write it is a warning: the
main record is never lost to it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kuangchao.platform.security.job_audit import JobAuditFiles
from kuangchao.platform.settings import audit_file, audit_roots

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AuditRecord:
    principal: str
    action: str
    resource: str
    decision: Literal["allow", "deny"]
    reason: str = ""
    job: str | None = None
    ts: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        # Field by field: `asdict` walks and copies, and every request that
        # changes state writes one.
        return {"principal": self.principal, "action": self.action, "resource": self.resource,
                "decision": self.decision, "reason": self.reason, "job": self.job, "ts": self.ts}


def default_trail(store: Any) -> AuditLog:
    """The trail a control-plane process keeps: the audit file (`KC_AUDIT_FILE`) and the
    stream, with per-job copies under the audit roots; the stream alone where the
    file's folder cannot be made here (said once, as a warning)."""
    try:
        return AuditLog(store, audit_file(), audit_roots())
    except OSError as exc:  # no audit folder here: the stream still gets the records
        log.warning("audit file not writable (%s); auditing to the stream only", exc)
        return AuditLog(store, None)


class AuditLog:
    """Writes records to a Redis stream and a JSONL file, and reads them back.

    Args:
        store: The job store (its `append_audit` and `audit_lines`), or None for
            the file alone.
        path: The JSONL file, or None for the stream alone.
        job_roots: The audit roots (`platform.settings.audit_roots()`): a job's
            records are also copied to its `permission.audit_log` under them,
            found in `store`'s job record. None: no per-job copies.
        job_files: Those copies' writer, given instead of `job_roots` (tests).
    """

    def __init__(self, store: Any, path: Path | None, job_roots: tuple[str, ...] | None = None,
                 job_files: JobAuditFiles | None = None) -> None:
        self.store, self.path = store, path
        self._lock = threading.Lock()
        self._file: Any = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        if job_files is None and job_roots is not None and store is not None:
            job_files = JobAuditFiles(store, job_roots)
        self.job_files = job_files
        self._job_errors: dict[str, str] = {}  # job -> its last warning, said once

    @staticmethod
    def line(rec: AuditRecord) -> str:
        """The record as both sinks hold it: one JSON line, keys sorted."""
        return json.dumps(rec.to_json(), sort_keys=True)

    def record(self, rec: AuditRecord, streamed: bool = False, line: str | None = None) -> None:
        """Write `rec` to the file, the stream and the job's own file.

        `streamed`: the caller already added `AuditLog.line(rec)` to the stream in
        the same Redis transaction as the change it records (a submit: one
        round trip for both, and no job without its record); the file and the
        job's copy are written here as for any record. `line`: `AuditLog.line(rec)`,
        when the caller has it.
        """
        line = self.line(rec) if line is None else line
        if self.path is not None:
            try:
                with self._lock:
                    self._write(line + "\n")
            except OSError as exc:
                log.error("audit file %s not written: %s; record: %s", self.path, exc, line)
        if self.store is not None and not streamed:
            try:
                self.store.append_audit(line)
            except Exception as exc:  # Redis away: the file still has it
                log.error("audit stream not written: %s; record: %s", exc, line)
        if rec.job and self.job_files is not None:
            self._copy_to_job(rec.job, line)

    def _copy_to_job(self, job: str, line: str) -> None:
        """The job's own audit file; a failure is a warning (once per job and cause)."""
        try:
            self.job_files.append(job, line + "\n", skip=self.path)  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 -- never lose the main record to it
            why = str(exc)
            with self._lock:
                said = self._job_errors.get(job) == why
                self._job_errors[job] = why
                if len(self._job_errors) > 1024:
                    self._job_errors.pop(next(iter(self._job_errors)))
            if not said:
                log.warning("job %s's audit file (permission.audit_log) not written: %s; "
                            "the main trail has the record", job, why)
        else:
            if self._job_errors:
                with self._lock:
                    self._job_errors.pop(job, None)

    def _write(self, line: str) -> None:
        # One handle kept open (opening per record cost more than the write);
        # a file rotated away or deleted is opened again.
        if self._file is None or not self.path.exists():  # type: ignore[union-attr]
            if self._file is not None:
                self._file.close()
            self._file = self.path.open("a")  # type: ignore[union-attr]
        try:
            self._file.write(line)
            self._file.flush()
        except OSError:
            self._file.close()
            self._file = None
            raise

    def read(self, job: str | None = None, since: float | None = None,
             decision: str | None = None, limit: int = 1000,
             action: str | None = None,
             jobs: Collection[str] | None = None) -> list[dict[str, Any]]:
        """The newest matching records, oldest first.

        `action` is `allow` or `deny` (the decision), else an action name
        (`job.cancel`) or its family (`job`). `jobs`: only records about one of
        these jobs (all the jobs of a task name, say); empty matches none.
        """
        if action in ("allow", "deny"):
            decision, action = action, None
        out: list[dict[str, Any]] = []
        for line in self.store.audit_lines(since):
            rec = json.loads(line)
            if job is not None and rec.get("job") != job:
                continue
            if jobs is not None and rec.get("job") not in jobs:
                continue
            if decision is not None and rec.get("decision") != decision:
                continue
            name = rec.get("action", "")
            if action is not None and name != action and not name.startswith(action + "."):
                continue
            out.append(rec)
            if len(out) >= limit:
                break
        return out[::-1]


class DenialSampler:
    """Keeps a flood of refusals from flushing the trail.

    The stream keeps the newest records only, so a few hundred thousand refused
    requests would push every earlier decision out of it. Each source (a
    client address for requests without a valid key, else the principal) may
    leave `burst` denial records per `window_s`; past that its refusals are
    counted, and the next record it may leave says how many were not written.
    Allowed decisions are never sampled.

    Pure: the caller passes the clock.
    """

    def __init__(self, burst: int = 20, window_s: float = 60.0, max_sources: int = 10_000) -> None:
        self.burst, self.window_s, self.max_sources = burst, window_s, max_sources
        self._lock = threading.Lock()
        self._seen: dict[str, list[float]] = {}  # source -> [window start, written, suppressed]

    def admit(self, source: str, now: float) -> tuple[bool, int]:
        """Whether to write this denial, and how many of the source's were skipped before it."""
        with self._lock:
            entry = self._seen.get(source)
            if entry is None or now - entry[0] >= self.window_s:
                skipped = int(entry[2]) if entry is not None else 0
                if entry is None and len(self._seen) >= self.max_sources:
                    self._forget(now)
                self._seen[source] = [now, 1, 0]
                return True, skipped
            if entry[1] < self.burst:
                entry[1] += 1
                skipped, entry[2] = int(entry[2]), 0
                return True, skipped
            entry[2] += 1
            return False, 0

    def _forget(self, now: float) -> None:
        """Drop sources whose window has passed (with nothing skipped), else the oldest."""
        stale = [s for s, e in self._seen.items() if now - e[0] >= self.window_s and not e[2]]
        for s in stale or sorted(self._seen, key=lambda s: self._seen[s][0])[:len(self._seen) // 2]:
            del self._seen[s]
