"""The in-memory store's retention purge, as retention_store.py does it in Redis. Pure."""

from __future__ import annotations

import json
import threading
from typing import Any

from kuangchao.platform.jobs.encoding import KEPT, PURGED, STALE, is_job_id


class MemoryRetention:
    """`purge_finished` over `MemoryStore`'s own tables."""

    _lock: threading.RLock
    _jobs: Any
    _streams: dict[str, Any]
    _progress: dict[str, Any]
    _samples: dict[str, Any]
    _controllers: dict[str, str]
    _flags: dict[tuple[str, str], Any]
    _metric_hashes: dict[str | None, Any]
    _fenced: dict[str, set[str]]
    _issued: dict[str, dict[str, float]]
    _users: set[str]

    def purge_finished(self, job_id: str, finished_before: float,
                       terminal: tuple[str, ...]) -> str:
        """As `JobStore.purge_finished`: `purged`, `kept` or `stale`."""
        if not is_job_id(job_id):
            return KEPT
        with self._lock:
            raw = self._jobs.text.get(job_id)
            if raw is not None:
                rec = json.loads(raw)
                fin = rec.get("finished_at")
                if rec.get("state") not in terminal or not isinstance(fin, int | float) \
                        or fin >= finished_before:
                    return KEPT
            self._jobs.text.pop(job_id, None)
            self._jobs.order = [e for e in self._jobs.order if e[1] != job_id]
            self._jobs.active.discard(job_id)
            for stream in self._streams.values():
                stream.pop(job_id, None)
            for table in (self._progress, self._samples, self._controllers, self._metric_hashes,
                          self._fenced, self._issued):
                table.pop(job_id, None)
            self._flags = {k: v for k, v in self._flags.items() if k[1] != job_id}
            self._users.discard(job_id)
            self._drop_targets(job_id)  # type: ignore[attr-defined]  # MemoryExtras's
            return PURGED if raw is not None else STALE
