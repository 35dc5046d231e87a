"""What a job appends to: events, logs, the loss curve, progress, checkpoints,
the sample record, and the ranks' reports with the controller's answers."""

from __future__ import annotations

import json
from typing import Any

import redis

from kuangchao.platform.jobs import keys
from kuangchao.platform.jobs.encoding import (
    EVENT_CAP,
    LOG_CAP,
    METRICS_CAP,
    REPORT_ANSWER_TTL_S,
    decoded,
    decoded_list,
    event_text,
    loads_or_none,
    log_text,
    progress_fields,
    sample_fields_from,
)


# The two writes a rank's heartbeat thread also makes, on its own pipeline
# (workers/runtime/heartbeat.py): the same commands, whoever sends them.
def queue_progress(pipe: Any, p: str, job_id: str, progress: dict[str, Any]) -> None:
    """Merge progress fields; `initial_loss` is written once and kept across restarts."""
    k = keys.progress(p, job_id)
    initial, rest = progress_fields(progress)
    if initial is not None:
        pipe.hsetnx(k, "initial_loss", initial)
    if rest:
        pipe.hset(k, mapping=rest)


def queue_points(pipe: Any, p: str, job_id: str, points: list[dict[str, Any]]) -> None:
    """Append loss-curve points, keeping the newest METRICS_CAP."""
    k = keys.curve(p, job_id)
    pipe.rpush(k, *[json.dumps(point) for point in points])
    pipe.ltrim(k, -METRICS_CAP, -1)


class Streams:
    """The streams part of `JobStore`."""

    r: redis.Redis
    p: str

    def add_event(self, job_id: str, event: dict[str, Any]) -> None:
        k = keys.events(self.p, job_id)
        with self.r.pipeline() as pipe:
            pipe.rpush(k, event_text(event))
            pipe.ltrim(k, -EVENT_CAP, -1)
            pipe.execute()

    def events(self, job_id: str, start: int = 0) -> list[dict[str, Any]]:
        return decoded_list(self.r.lrange(keys.events(self.p, job_id), start, -1))

    def add_logs(self, job_id: str, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        k = keys.logs(self.p, job_id)
        with self.r.pipeline() as pipe:
            pipe.rpush(k, *[log_text(r) for r in records])
            pipe.ltrim(k, -LOG_CAP, -1)
            pipe.execute()

    def logs(self, job_id: str, start: int = 0) -> list[dict[str, Any]]:
        return decoded_list(self.r.lrange(keys.logs(self.p, job_id), start, -1))

    def add_metrics(self, job_id: str, points: list[dict[str, Any]]) -> None:
        if not points:
            return
        with self.r.pipeline() as pipe:
            queue_points(pipe, self.p, job_id, points)
            pipe.execute()

    def metrics(self, job_id: str, start: int = 0) -> list[dict[str, Any]]:
        """Logged points from `start` on, oldest first. A step replayed after a
        recovery appears again, with the recovered run's values."""
        return decoded_list(self.r.lrange(keys.curve(self.p, job_id), start, -1))

    def set_progress(self, job_id: str, progress: dict[str, Any]) -> None:
        """Merge progress fields; `initial_loss` is written once and kept across restarts."""
        with self.r.pipeline() as pipe:
            queue_progress(pipe, self.p, job_id, progress)
            pipe.execute()

    def progress(self, job_id: str) -> dict[str, Any]:
        return decoded(self.r.hgetall(keys.progress(self.p, job_id)))

    def add_checkpoint(self, job_id: str, ckpt: dict[str, Any]) -> None:
        self.r.rpush(keys.checkpoints(self.p, job_id), json.dumps(ckpt))

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        return decoded_list(self.r.lrange(keys.checkpoints(self.p, job_id), 0, -1))

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
        return decoded_list(raw)

    def answer_report(self, job_id: str, report_id: str, answer: Any,
                      ttl_s: int = REPORT_ANSWER_TTL_S) -> None:
        self.r.set(keys.answer(self.p, job_id, report_id), json.dumps(answer), ex=ttl_s)

    def report_answer(self, job_id: str, report_id: str) -> Any:
        """The controller's answer to a report, or None while there is none."""
        return loads_or_none(self.r.get(keys.answer(self.p, job_id, report_id)))

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
        undone = sample_fields_from(self.r.hkeys(key), step)
        if undone:
            self.r.hdel(key, *undone)
