"""The parts of the in-memory store (memory.py) beyond records, streams, flags and
node health: values that expire, and metric hashes with scrape targets. Pure."""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from collections.abc import Hashable
from typing import Any

from kuangchao.platform.jobs.scrape_reads import read_for_gauges
from kuangchao.platform.observability.metrics import MetricsRecorder


class Expiring:
    """Values that vanish `ttl_s` after they were put (Redis's `SET ... EX`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[Hashable, tuple[float | None, Any]] = {}

    def put(self, key: Hashable, value: Any, ttl_s: float | None = None) -> None:
        with self._lock:
            self._items[key] = (time.monotonic() + ttl_s if ttl_s else None, value)

    def get(self, key: Hashable) -> Any:
        with self._lock:
            until, value = self._items.get(key, (None, None))
            if until is not None and until <= time.monotonic():
                del self._items[key]
                return None
            return value

    def pop(self, key: Hashable) -> Any:
        value = self.get(key)
        with self._lock:
            self._items.pop(key, None)
        return value


class MemoryExtras:
    """Metric hashes and scrape targets, as `Recorded` keeps them in Redis."""

    _lock: threading.RLock

    def __init__(self) -> None:
        self._metric_hashes: defaultdict[str | None, defaultdict[str, float]] = defaultdict(
            lambda: defaultdict(float))
        self._targets: defaultdict[str, dict[str, str]] = defaultdict(dict)

    # -- metrics -------------------------------------------------------------------
    def read_for_gauges(self, jobs: list[tuple[str, int]]) -> dict[str, Any]:
        return read_for_gauges(self, jobs)  # type: ignore[arg-type]

    def recorder(self, job_id: str | None = None) -> MetricsRecorder:
        return MetricsRecorder(lambda fields: self.add_metric_fields(job_id, fields),
                               f"memory metrics of {job_id or 'the cluster'}")

    def add_metric_fields(self, job_id: str | None, fields: dict[str, float]) -> None:
        with self._lock:
            self._add_metric_fields(job_id, fields)

    def _add_metric_fields(self, job_id: str | None, fields: dict[str, float]) -> None:
        counts = self._metric_hashes[job_id]
        for f, v in fields.items():
            counts[f] += float(v)

    def metric_fields(self, job_id: str | None = None) -> dict[str, float]:
        with self._lock:
            return dict(self._metric_hashes.get(job_id, {}))

    # -- scrape targets ----------------------------------------------------------
    def register_target(self, job_id: str, rank: int, entry: dict[str, Any]) -> None:
        with self._lock:
            self._targets[job_id][str(rank)] = json.dumps(entry)

    def unregister_target(self, job_id: str, rank: int, pid: int) -> None:
        with self._lock:
            entries = self._targets.get(job_id, {})
            raw = entries.get(str(rank))
            if raw and json.loads(raw).get("pid") == pid:
                del entries[str(rank)]

    def targets(self, job_ids: list[str]) -> dict[str, dict[str, str]]:
        with self._lock:
            return {j: dict(self._targets.get(j, {})) for j in job_ids}

    def _drop_targets(self, job_id: str) -> None:
        self._targets.pop(job_id, None)
