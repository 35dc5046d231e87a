"""What `/metrics` reads from the store for its gauges, for every active job at once.

`read_for_gauges` composes the store's public reads (the in-memory store uses
it as is); the Redis store does the same reads in one pipelined round trip,
since the API answers every Prometheus scrape with them. Pure.
"""

from __future__ import annotations

from typing import Any, Protocol

from kuangchao.platform.protocol.heartbeat import Beat


class _Reads(Protocol):
    def metric_fields(self, job_id: str | None = None) -> dict[str, float]: ...
    def info(self, name: str) -> dict[str, Any] | None: ...
    def progress(self, job_id: str) -> dict[str, Any]: ...
    def checkpoints(self, job_id: str) -> list[dict[str, Any]]: ...
    def beats(self, job_id: str, ranks: Any) -> dict[int, Beat | None]: ...


def read_for_gauges(store: _Reads, jobs: list[tuple[str, int]]) -> dict[str, Any]:
    """The recorded fields of the cluster and of each job, the node and queue tables,
    and each job's progress, newest checkpoint and rank beats (None where missing).

    Args:
        jobs: (job id, world size) of each job to read.
    """
    out: dict[str, Any] = {"cluster": store.metric_fields(), "nodes": store.info("nodes"),
                           "queues": store.info("queues"), "jobs": {}, "progress": {},
                           "checkpoint": {}, "beats": {}}
    for job_id, world in jobs:
        out["jobs"][job_id] = store.metric_fields(job_id)
        out["progress"][job_id] = store.progress(job_id)
        ckpts = store.checkpoints(job_id)
        out["checkpoint"][job_id] = ckpts[-1] if ckpts else None
        beats = store.beats(job_id, range(max(1, world)))
        out["beats"][job_id] = [beats.get(r) for r in range(max(1, world))]
    return out
