"""What the control plane and the ranks record for Prometheus: counters and
histograms (one hash for the cluster, one per job) and each rank's metrics
endpoint (the scrape targets)."""

from __future__ import annotations

import json
from typing import Any

import redis

from kuangchao.platform.jobs import keys
from kuangchao.platform.observability.metrics import MetricsRecorder


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
