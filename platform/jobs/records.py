"""Job records: create, read and update them with compare-and-set on a version.

Writers that race (API, scheduler, job controller) never lose an update: each
commit is one Lua script that sets the record only when the version read is
still the stored one, and appends its event, and for a finished job updates the
active set, the scrape targets and the finished counter, in the same step.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import redis

from kuangchao.platform.errors import JobNotFound
from kuangchao.platform.jobs import keys
from kuangchao.platform.jobs.encoding import (
    AUDIT_CAP,
    EVENT_CAP,
    created_event,
    event_text,
    is_job_id,
)
from kuangchao.platform.jobs.record_edits import RecordEdits
from kuangchao.platform.jobs.state import JobRecord
from kuangchao.platform.observability import metrics

# One commit of a record: set it only when the stored version still matches the
# one read, and, in the same atomic step, append its event, take a finished job
# out of the active set (and Prometheus's targets) and count it as finished. A
# crash between the steps can no longer lose the event or leave a finished job
# active. The metric field comes from the metrics catalogue (metrics.increments).
#   KEYS: record, events, and only for a commit that finishes the job: the active
#         set, scrape targets, cluster metrics hash (a job's own Redis user, which
#         may name only its job's keys, never finishes a job)
#   ARGV: version read, new record, event ('' for none), event cap,
#         job id, finished-metric field
COMMIT_SCRIPT = """
local cur = redis.call('GET', KEYS[1])
if not cur then return -1 end
local v = cjson.decode(cur)['version']
if tostring(v) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
if ARGV[3] ~= '' then
  redis.call('RPUSH', KEYS[2], ARGV[3])
  redis.call('LTRIM', KEYS[2], -tonumber(ARGV[4]), -1)
end
if #KEYS == 5 then
  redis.call('SREM', KEYS[3], ARGV[5])
  redis.call('DEL', KEYS[4])
  redis.call('HINCRBYFLOAT', KEYS[5], ARGV[6], 1)
end
return 1
"""


# A new job: its record (never over an existing one), its place in the index and
# the active set, its first event, the scheduler's wake-up and, for the API, the
# audit record of the submission. One script: one round trip, all or nothing
# (a MULTI pipeline of the same commands cost the client twice the packing).
#   KEYS: record, jobs index, active set, events, scheduler wake list[, audit stream]
#   ARGV: record JSON, created_at, job id, created event[, audit line, audit cap]
CREATE_SCRIPT = """
redis.call('SET', KEYS[1], ARGV[1], 'NX')
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
redis.call('SADD', KEYS[3], ARGV[3])
redis.call('RPUSH', KEYS[4], ARGV[4])
redis.call('RPUSH', KEYS[5], ARGV[3])
if #KEYS == 6 then
  redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[6], '*', 'r', ARGV[5])
end
return 1
"""


class Records(RecordEdits):
    """The records part of `JobStore` (it holds the client and the prefix)."""

    r: redis.Redis
    p: str
    _commit: Any
    _create: Any

    def create(self, job: JobRecord, event_message: str = "submitted",
               audit_line: str | None = None) -> JobRecord:
        """Store a new job, its first event, and wake the scheduler: one transaction.

        `audit_line`: the audit record of the submission (`AuditLog.line`), added
        to the audit stream in the same transaction, so that a submit costs one
        round trip and no job exists without its record.
        """
        job = dataclasses.replace(job, version=1)
        names = [keys.job(self.p, job.id), keys.jobs(self.p), keys.active(self.p),
                 keys.events(self.p, job.id), keys.sched_wake(self.p)]
        args = [json.dumps(job.to_json()), repr(job.created_at), job.id,
                created_event(job.created_at, job.state.value, event_message)]
        if audit_line is not None:
            names.append(keys.audit(self.p))
            args += [audit_line, str(AUDIT_CAP)]
        self._create(names, args)
        return job

    def get(self, job_id: str) -> JobRecord:
        if not is_job_id(job_id):  # answers as a missing job: nothing about others leaks
            raise JobNotFound.for_id(job_id)
        raw = self.r.get(keys.job(self.p, job_id))
        if raw is None:
            raise JobNotFound.for_id(job_id)
        return JobRecord.from_json(json.loads(raw))

    def jobs_before(self, before: tuple[float, str] | None,
                    count: int) -> list[tuple[float, str, JobRecord | None]]:
        """Up to `count` entries of the `jobs` index just older than `before`, a
        (created_at, id) position, newest first: (created_at, id, record, None
        when the record is gone). From the newest with `before` None. Positions
        are exact, so a walk from page to page sees each job once, however many
        jobs arrive meanwhile."""
        hi: float | str = "+inf" if before is None else before[0]
        got: list[tuple[float, str]] = []
        offset = 0
        while len(got) < count:  # ties on created_at: skip the ones at or after `before`
            batch = self.r.zrevrangebyscore(keys.jobs(self.p), hi, "-inf", start=offset,
                                            num=count, withscores=True)
            offset += len(batch)
            got += [(float(s), i) for i, s in batch if before is None or (float(s), i) < before]
            if len(batch) < count:
                break
        got = got[:count]
        raws = self.r.mget([keys.job(self.p, i) for _, i in got]) if got else []
        return [(s, i, JobRecord.from_json(json.loads(raw)) if raw else None)
                for (s, i), raw in zip(got, raws, strict=True)]

    def list(self, limit: int = 1000, before: int = 0) -> list[JobRecord]:
        """The newest `limit` jobs, oldest first; with `before`, the newest `before`
        are skipped (the next page back)."""
        return self._records(self.r.zrange(keys.jobs(self.p), -(before + limit), -(before + 1)))

    def list_active(self) -> list[JobRecord]:
        """Every job that has not finished, however old, oldest first."""
        jobs = self._records(list(self.r.smembers(keys.active(self.p))))
        return sorted(jobs, key=lambda j: (j.created_at, j.id))

    def _records(self, ids: list[str]) -> list[JobRecord]:
        if not ids:
            return []
        raws = self.r.mget([keys.job(self.p, i) for i in ids])
        return [JobRecord.from_json(json.loads(r)) for r in raws if r]

    def _commit_change(self, cur: JobRecord, new: JobRecord, event: dict[str, Any] | None) -> bool | None:
        ok = self._commit(*self._commit_call(cur, new, event))
        return None if ok == -1 else ok == 1

    def _commit_call(self, cur: JobRecord, new: JobRecord,
                     event: dict[str, Any] | None) -> tuple[list[str], list[str]]:
        """The commit script's keys and arguments for `cur` becoming `new`."""
        names = [keys.job(self.p, new.id), keys.events(self.p, new.id)]
        args = [str(cur.version), json.dumps(new.to_json()),
                event_text(event) if event else "", str(EVENT_CAP),
                new.id]
        if new.state.is_terminal and not cur.state.is_terminal:
            (finished,) = metrics.increments(metrics.JOBS_FINISHED, 1.0,
                                             {"state": new.state.value, "queue": new.queue})
            names += [keys.active(self.p), keys.targets(self.p, new.id),
                     keys.cluster_metrics(self.p)]
            args.append(finished)
        return names, args

    def claim_controller(self, job_id: str, ident: str) -> str | None:
        """Record `ident` (`name/pid`) as the job's controller; return the one recorded before."""
        return self.r.set(keys.controller(self.p, job_id), ident, get=True)

    def controller(self, job_id: str) -> str | None:
        """The `name/pid` of the controller last recorded for the job."""
        return self.r.get(keys.controller(self.p, job_id))
