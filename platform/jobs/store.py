"""Job state in Redis.

Key names come from platform/jobs/keys.py (docs/architecture.md has the table).

Writers that race (API, scheduler, job controller) update a record with
compare-and-set on its version, so no update is ever lost.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from kuangchao.platform.errors import JobNotFound, StoreUnavailable
from kuangchao.platform.jobs import keys
from kuangchao.platform.jobs.state import JobRecord
from kuangchao.platform.observability import metrics

LOG_CAP = 20_000
# A point per logged step: 50k points cover a million steps logged every 20.
METRICS_CAP = 50_000
EVENT_CAP = 5_000

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
_COMMIT_SCRIPT = """
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


def connect(url: str | None) -> redis.Redis:
    """Open and check a Redis connection.

    Raises:
        StoreUnavailable: When no URL is configured or Redis does not answer.
    """
    if not url:
        raise StoreUnavailable(
            "no Redis configured: set KC_REDIS_URL (e.g. redis://127.0.0.1:6379/0), "
            "or run `kc up`, which starts an embedded Valkey"
        )
    try:
        client = redis.Redis.from_url(
            url, decode_responses=True, socket_connect_timeout=5, socket_timeout=30,
            health_check_interval=30, retry=Retry(NoBackoff(), 0),
        )
        client.ping()  # fail fast, with a clear message, when Redis is not there at all
        client.set_retry(riding_retry())
    except (redis.ConnectionError, redis.TimeoutError, redis.AuthenticationError, ValueError) as exc:
        raise StoreUnavailable(
            f"cannot reach Redis at {redact(url)}: {exc}. Check that it is running, or set "
            "KC_REDIS_URL to a reachable Redis"
        ) from None
    except redis.ResponseError as exc:
        raise StoreUnavailable(f"Redis at {redact(url)} refused the connection: {exc}") from None
    return client


def riding_retry() -> Retry:
    """Retries that ride out a Redis restart (about 15 s) instead of failing the caller."""
    return Retry(ExponentialBackoff(cap=2.0, base=0.1), 12)


def redact(url: str) -> str:
    """The URL with any password replaced, for messages and logs."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.split('@', 1)[1]}"


class JobStore:
    """Typed access to the job keys. Safe to share between threads."""

    def __init__(self, client: redis.Redis, prefix: str = "kc:") -> None:
        self.r = client
        self.p = prefix
        self._commit = client.register_script(_COMMIT_SCRIPT)

    @classmethod
    def from_url(cls, url: str | None, prefix: str = "kc:") -> JobStore:
        return cls(connect(url), prefix)

    # -- records -----------------------------------------------------------
    def create(self, job: JobRecord, event_message: str = "submitted") -> JobRecord:
        job = dataclasses.replace(job, version=1)
        with self.r.pipeline() as pipe:
            pipe.set(keys.job(self.p, job.id), json.dumps(job.to_json()), nx=True)
            pipe.zadd(keys.jobs(self.p), {job.id: job.created_at})
            pipe.sadd(keys.active(self.p), job.id)
            pipe.rpush(keys.events(self.p, job.id), json.dumps(
                {"ts": job.created_at, "type": "state", "from": None, "to": job.state.value,
                 "message": event_message}))
            pipe.rpush(keys.sched_wake(self.p), job.id)
            pipe.execute()
        return job

    def get(self, job_id: str) -> JobRecord:
        raw = self.r.get(keys.job(self.p, job_id))
        if raw is None:
            raise JobNotFound.for_id(job_id)
        return JobRecord.from_json(json.loads(raw))

    def list(self, limit: int = 1000) -> list[JobRecord]:
        """The newest `limit` jobs, oldest first."""
        return self._records(self.r.zrange(keys.jobs(self.p), -limit, -1))

    def list_active(self) -> list[JobRecord]:
        """Every job that has not finished, however old, oldest first."""
        jobs = self._records(list(self.r.smembers(keys.active(self.p))))
        return sorted(jobs, key=lambda j: (j.created_at, j.id))

    def _records(self, ids: list[str]) -> list[JobRecord]:
        if not ids:
            return []
        raws = self.r.mget([keys.job(self.p, i) for i in ids])
        return [JobRecord.from_json(json.loads(r)) for r in raws if r]

    def update(
        self,
        job_id: str,
        fn: Callable[[JobRecord], tuple[JobRecord, dict | None] | None],
        attempts: int = 50,
    ) -> JobRecord | None:
        """Read-modify-write with compare-and-set.

        Args:
            job_id: The job.
            fn: Given the current record, returns `(new_record, event_or_None)`,
                or None to leave the record alone. It may run more than once.

        Returns:
            The stored new record, or None when `fn` chose not to change it.
        """
        for _ in range(attempts):
            cur = self.get(job_id)
            out = fn(cur)
            if out is None:
                return None
            new, event = out
            new = dataclasses.replace(new, version=cur.version + 1)
            ok = self._commit(*self._commit_call(cur, new, event))
            if ok == 1:
                return new
            if ok == -1:
                raise JobNotFound(f"job {job_id!r} vanished from the store")
        raise StoreUnavailable(f"job {job_id}: too much write contention; retry the request")

    def _commit_call(self, cur: JobRecord, new: JobRecord,
                     event: dict[str, Any] | None) -> tuple[list[str], list[str]]:
        """The commit script's keys and arguments for `cur` becoming `new`."""
        names = [keys.job(self.p, new.id), keys.events(self.p, new.id)]
        args = [str(cur.version), json.dumps(new.to_json()),
                json.dumps({"ts": time.time(), **event}, default=str) if event else "", str(EVENT_CAP),
                new.id]
        if new.state.is_terminal and not cur.state.is_terminal:
            (finished,) = metrics.increments(metrics.JOBS_FINISHED, 1.0,
                                             {"state": new.state.value, "queue": new.queue})
            names += [keys.active(self.p), keys.targets(self.p, new.id),
                     keys.cluster_metrics(self.p)]
            args.append(finished)
        return names, args

    # -- events, logs, progress, checkpoints -------------------------------
    def add_event(self, job_id: str, event: dict[str, Any]) -> None:
        event = {"ts": time.time(), **event}
        k = keys.events(self.p, job_id)
        with self.r.pipeline() as pipe:
            pipe.rpush(k, json.dumps(event, default=str))
            pipe.ltrim(k, -EVENT_CAP, -1)
            pipe.execute()

    def events(self, job_id: str, start: int = 0) -> list[dict[str, Any]]:
        return [json.loads(e) for e in self.r.lrange(keys.events(self.p, job_id), start, -1)]

    def add_logs(self, job_id: str, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        k = keys.logs(self.p, job_id)
        with self.r.pipeline() as pipe:
            pipe.rpush(k, *[json.dumps(r, default=str) for r in records])
            pipe.ltrim(k, -LOG_CAP, -1)
            pipe.execute()

    def logs(self, job_id: str, start: int = 0) -> list[dict[str, Any]]:
        return [json.loads(e) for e in self.r.lrange(keys.logs(self.p, job_id), start, -1)]

    def add_metrics(self, job_id: str, points: list[dict[str, Any]]) -> None:
        if not points:
            return
        k = keys.curve(self.p, job_id)
        with self.r.pipeline() as pipe:
            pipe.rpush(k, *[json.dumps(p) for p in points])
            pipe.ltrim(k, -METRICS_CAP, -1)
            pipe.execute()

    def metrics(self, job_id: str, start: int = 0) -> list[dict[str, Any]]:
        """Logged points from `start` on, oldest first. A step replayed after a
        recovery appears again, with the recovered run's values."""
        return [json.loads(e) for e in self.r.lrange(keys.curve(self.p, job_id), start, -1)]

    def set_progress(self, job_id: str, progress: dict[str, Any]) -> None:
        """Merge progress fields; `initial_loss` is written once and kept across restarts."""
        k = keys.progress(self.p, job_id)
        progress = dict(progress)
        initial = progress.pop("initial_loss", None)
        with self.r.pipeline() as pipe:
            if initial is not None:
                pipe.hsetnx(k, "initial_loss", json.dumps(initial))
            if progress:
                pipe.hset(k, mapping={f: json.dumps(v) for f, v in progress.items()})
            pipe.execute()

    def progress(self, job_id: str) -> dict[str, Any]:
        raw = self.r.hgetall(keys.progress(self.p, job_id))
        return {k: json.loads(v) for k, v in raw.items()}

    def add_checkpoint(self, job_id: str, ckpt: dict[str, Any]) -> None:
        self.r.rpush(keys.checkpoints(self.p, job_id), json.dumps(ckpt))

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        return [json.loads(c) for c in self.r.lrange(keys.checkpoints(self.p, job_id), 0, -1)]

    def annotate_restart(self, job_id: str, fields: dict[str, Any]) -> JobRecord | None:
        """Add timings to the newest restart entry, keeping fields already set.

        A no-op when the job has no restart or the newest one already has
        every field (a preemption's resume, say, must not touch it).
        """
        return self._annotate_last(job_id, "restart_log", fields)

    def annotate_resize(self, job_id: str, fields: dict[str, Any]) -> JobRecord | None:
        """Add fields to the newest resize entry, keeping those already set."""
        return self._annotate_last(job_id, "resize_log", fields)

    def _annotate_last(self, job_id: str, log: str, fields: dict[str, Any]) -> JobRecord | None:
        def add(j: JobRecord):
            entries = getattr(j, log)
            if not entries:
                return None
            last = entries[-1]
            new = {k: v for k, v in fields.items() if k not in last and v is not None}
            if not new:
                return None
            return dataclasses.replace(j, **{log: (*entries[:-1], {**last, **new})}), None
        return self.update(job_id, add)

    def close_resize(self, job_id: str, first_step_at: float, world_size: int) -> dict[str, Any] | None:
        """Stamp the open resize entry to `world_size` ranks with its first step and
        `resize_s` (decision to first step), in one update; returns it, or None."""
        out: dict[str, Any] = {}

        def close(j: JobRecord):
            last = j.resize_log[-1] if j.resize_log else None
            if (last is None or "first_step_at" in last or "requested_at" not in last
                    or last.get("to_world_size") != world_size):
                return None
            out.update(last, first_step_at=first_step_at,
                       resize_s=round(first_step_at - last["requested_at"], 3))
            return dataclasses.replace(j, resize_log=(*j.resize_log[:-1], dict(out))), None
        return out if self.update(job_id, close) is not None else None

    def claim_controller(self, job_id: str, ident: str) -> str | None:
        """Record `ident` (`name/pid`) as the job's controller; return the one recorded before."""
        return self.r.set(keys.controller(self.p, job_id), ident, get=True)

    def controller(self, job_id: str) -> str | None:
        """The `name/pid` of the controller last recorded for the job."""
        return self.r.get(keys.controller(self.p, job_id))

    # -- reports from the ranks --------------------------------------------------
    # Ranks never write the job record: what they have to tell the control plane
    # (a numeric fault, a rollback done, the first step after a restart or resize)
    # goes on this list, and the job's controller applies it
    # (platform/execution/reports.py).
    def post_report(self, job_id: str, report: dict[str, Any]) -> None:
        self.r.rpush(keys.reports(self.p, job_id), json.dumps(report, default=str))

    def take_reports(self, job_id: str) -> list[dict[str, Any]]:
        """Every report posted and not yet taken, oldest first; each is taken once."""
        k = keys.reports(self.p, job_id)
        with self.r.pipeline() as pipe:  # MULTI: a report posted meanwhile waits for the next take
            pipe.lrange(k, 0, -1)
            pipe.delete(k)
            raw, _ = pipe.execute()
        return [json.loads(r) for r in raw]

    def answer_report(self, job_id: str, report_id: str, answer: Any, ttl_s: int = 600) -> None:
        self.r.set(keys.answer(self.p, job_id, report_id), json.dumps(answer), ex=ttl_s)

    def report_answer(self, job_id: str, report_id: str) -> Any:
        """The controller's answer to a report, or None while there is none."""
        raw = self.r.get(keys.answer(self.p, job_id, report_id))
        return json.loads(raw) if raw is not None else None

    # -- heartbeats and stacks ------------------------------------------------
    def request_stacks(self, job_id: str, ranks: list[int], ttl_s: float = 60.0) -> None:
        with self.r.pipeline(transaction=False) as pipe:
            for rank in ranks:
                pipe.delete(keys.stacks(self.p, job_id, rank))
                pipe.set(keys.stack_request(self.p, job_id, rank), "1", ex=int(ttl_s))
            pipe.execute()

    def stacks(self, job_id: str, ranks: list[int]) -> dict[int, str]:
        values = self.r.mget([keys.stacks(self.p, job_id, r) for r in ranks])
        return {r: v for r, v in zip(ranks, values, strict=True) if v}

    # -- node quarantine -------------------------------------------------------
    def record_node_failure(self, node: str, ts: float, window_s: float) -> list[float]:
        """Add one failure to a node's history; return its failures within the window."""
        k = keys.node_failures(self.p, node)
        with self.r.pipeline() as pipe:
            pipe.zadd(k, {f"{ts:.6f}": ts})
            pipe.zremrangebyscore(k, "-inf", ts - window_s)
            pipe.expire(k, int(window_s) + 60)
            pipe.zrange(k, 0, -1, withscores=True)
            *_, members = pipe.execute()
        return [score for _, score in members]

    def quarantine_node(self, node: str, entry: dict[str, Any]) -> None:
        self.r.hset(keys.quarantine(self.p), node, json.dumps(entry))

    def release_node(self, node: str) -> bool:
        with self.r.pipeline() as pipe:
            pipe.hdel(keys.quarantine(self.p), node)
            pipe.delete(keys.node_failures(self.p, node))
            removed, _ = pipe.execute()
        return bool(removed)

    def quarantine(self) -> dict[str, dict[str, Any]]:
        """Every stored quarantine entry (expired ones included; see quarantine.active)."""
        return {k: json.loads(v) for k, v in self.r.hgetall(keys.quarantine(self.p)).items()}

    # -- cancellation and scheduler wake-ups --------------------------------
    def request_cancel(self, job_id: str) -> None:
        self.r.set(keys.cancel(self.p, job_id), "1")
        self.wake_scheduler(job_id)

    def cancel_requested(self, job_id: str) -> bool:
        return bool(self.r.exists(keys.cancel(self.p, job_id)))

    def request_preempt(self, job_id: str, for_job: str) -> None:
        self.r.set(keys.preempt(self.p, job_id), for_job)

    def preempt_requested(self, job_id: str) -> bool:
        return bool(self.r.exists(keys.preempt(self.p, job_id)))

    def clear_preempt(self, job_id: str) -> None:
        self.r.delete(keys.preempt(self.p, job_id))

    # -- elastic resizes -----------------------------------------------------
    # The scheduler raises `resize` for the job's controller (the request itself is
    # on the record); the controller publishes each new process-group generation
    # and raises `rejoin` with its number for the ranks, which read it every step.
    def request_resize(self, job_id: str) -> None:
        self.r.set(keys.resize(self.p, job_id), "1")

    def resize_requested(self, job_id: str) -> bool:
        return bool(self.r.exists(keys.resize(self.p, job_id)))

    def clear_resize(self, job_id: str) -> None:
        self.r.delete(keys.resize(self.p, job_id))

    def publish_generation(self, job_id: str, generation: dict[str, Any], signal: bool) -> None:
        """Store the next generation; with `signal`, ask running ranks to rejoin at their next step."""
        with self.r.pipeline() as pipe:
            pipe.set(keys.generation(self.p, job_id), json.dumps(generation))
            if signal:
                pipe.set(keys.rejoin(self.p, job_id), str(generation["gen"]))
            else:  # a group formed from scratch: no earlier request may reach its ranks
                pipe.delete(keys.rejoin(self.p, job_id))
            pipe.execute()

    def generation(self, job_id: str) -> dict[str, Any] | None:
        raw = self.r.get(keys.generation(self.p, job_id))
        return json.loads(raw) if raw else None

    def rejoin_requested(self, job_id: str) -> int:
        """The generation ranks are asked to rejoin, 0 when none."""
        raw = self.r.get(keys.rejoin(self.p, job_id))
        return int(raw) if raw else 0

    def clear_rejoin(self, job_id: str) -> None:
        self.r.delete(keys.rejoin(self.p, job_id))

    # The sample record of `data.record_samples`: field "step/dp_size/dp_rank",
    # value "start:stop,..." (the global sample indices of each micro-batch).
    def record_samples(self, job_id: str, fields: dict[str, str]) -> None:
        if fields:
            self.r.hset(keys.samples(self.p, job_id), mapping=fields)

    def samples(self, job_id: str) -> dict[str, str]:
        return self.r.hgetall(keys.samples(self.p, job_id))

    def forget_samples_from(self, job_id: str, step: int) -> None:
        """Drop the record of steps `step` and later (a restore undid them)."""
        key = keys.samples(self.p, job_id)
        undone = [f for f in self.r.hkeys(key) if int(f.split("/", 1)[0]) >= step]
        if undone:
            self.r.hdel(key, *undone)

    def wake_scheduler(self, reason: str = "") -> None:
        self.r.rpush(keys.sched_wake(self.p), reason or "tick")

    def wait_for_wake(self, timeout_s: float) -> None:
        """Block until someone wakes the scheduler or `timeout_s` passes."""
        got = self.r.blpop([keys.sched_wake(self.p)], timeout=timeout_s)
        if got:  # drain the backlog: one cycle serves all pending wake-ups
            self.r.delete(keys.sched_wake(self.p))

    # -- cluster-wide info ---------------------------------------------------
    def set_info(self, name: str, value: dict[str, Any]) -> None:
        self.r.set(keys.info(self.p, name), json.dumps(value))

    def info(self, name: str) -> dict[str, Any] | None:
        raw = self.r.get(keys.info(self.p, name))
        return json.loads(raw) if raw else None
