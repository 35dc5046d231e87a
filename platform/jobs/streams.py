"""What a job appends to: events, logs, the loss curve, progress, checkpoints,
the sample record, and the ranks' reports with the controller's answers."""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from kuangchao.platform.jobs import keys

LOG_CAP = 20_000
# A point per logged step: 50k points cover a million steps logged every 20.
METRICS_CAP = 50_000
EVENT_CAP = 5_000


class Streams:
    """The streams part of `JobStore`."""

    r: redis.Redis
    p: str

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
