"""What the control plane and the ranks record for Prometheus: counters and
histograms (one hash for the cluster, one per job) and each rank's metrics
endpoint (the scrape targets)."""

from __future__ import annotations

import json
from typing import Any

import redis

from kuangchao.platform.jobs import keys
from kuangchao.platform.jobs.encoding import decoded
from kuangchao.platform.observability.metrics import MetricsRecorder
from kuangchao.platform.protocol.heartbeat import Beat


class Recorded:
    """The metrics-and-targets part of `JobStore`."""

    r: redis.Redis
    p: str

    def _metrics_key(self, job_id: str | None) -> str:
        return keys.cluster_metrics(self.p) if job_id is None else keys.job_metrics(self.p, job_id)

    def recorder(self, job_id: str | None = None) -> MetricsRecorder:
        """A recorder into the cluster's metrics hash, or into the job's (which the
        job's own Redis user may write)."""
        return MetricsRecorder(lambda fields: self.add_metric_fields(job_id, fields),
                               self._metrics_key(job_id))

    def add_metric_fields(self, job_id: str | None, fields: dict[str, float]) -> None:
        key = self._metrics_key(job_id)
        with self.r.pipeline(transaction=False) as pipe:
            for f, v in fields.items():
                pipe.hincrbyfloat(key, f, v)
            pipe.execute()

    def metric_fields(self, job_id: str | None = None) -> dict[str, float]:
        """The recorded fields of the cluster (None) or of one job."""
        return {f: float(v) for f, v in self.r.hgetall(self._metrics_key(job_id)).items()}

    def register_target(self, job_id: str, rank: int, entry: dict[str, Any]) -> None:
        self.r.hset(keys.targets(self.p, job_id), str(rank), json.dumps(entry))

    def unregister_target(self, job_id: str, rank: int, pid: int) -> None:
        """Take the rank's entry away, unless another process (`pid` differs) has taken the rank since."""
        key = keys.targets(self.p, job_id)
        raw = self.r.hget(key, str(rank))
        if raw and json.loads(raw).get("pid") == pid:
            self.r.hdel(key, str(rank))

    def targets(self, job_ids: list[str]) -> dict[str, dict[str, str]]:
        """Each job's registered endpoints, rank -> JSON entry, in one round trip."""
        with self.r.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hgetall(keys.targets(self.p, job_id))
            raws = pipe.execute()
        return dict(zip(job_ids, raws, strict=True))

    def read_for_gauges(self, jobs: list[tuple[str, int]]) -> dict[str, Any]:
        """`scrape_reads.read_for_gauges`, in one pipelined round trip."""
        with self.r.pipeline(transaction=False) as pipe:
            pipe.hgetall(keys.cluster_metrics(self.p))
            pipe.get(keys.info(self.p, "nodes"))
            pipe.get(keys.info(self.p, "queues"))
            for job_id, world in jobs:
                pipe.hgetall(keys.job_metrics(self.p, job_id))
                pipe.hgetall(keys.progress(self.p, job_id))
                pipe.lindex(keys.checkpoints(self.p, job_id), -1)
                pipe.mget([keys.beat(self.p, job_id, r) for r in range(max(1, world))])
            out = pipe.execute()
        reads: dict[str, Any] = {"cluster": _floats(out[0]), "nodes": _json(out[1]),
                                 "queues": _json(out[2]), "jobs": {}, "progress": {},
                                 "checkpoint": {}, "beats": {}}
        for i, (job_id, _) in enumerate(jobs):
            base = 3 + 4 * i
            reads["jobs"][job_id] = _floats(out[base])
            reads["progress"][job_id] = decoded(out[base + 1])
            reads["checkpoint"][job_id] = _json(out[base + 2])
            reads["beats"][job_id] = [Beat.decode(r, raw) if raw else None
                                      for r, raw in enumerate(out[base + 3])]
        return reads


def _floats(raw: dict[str, str]) -> dict[str, float]:
    out = {}
    for f, v in raw.items():
        try:
            out[f] = float(v)
        except ValueError:
            continue  # not a number: parse_hash would skip it too
    return out


def _json(raw: str | None) -> Any:
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None  # a corrupt table reads as missing; the gauges fall back
