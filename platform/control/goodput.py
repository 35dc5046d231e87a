"""A job's goodput as the API shows it: read from the store, split by the ledger.

`job_goodput` reads the four records the ledger needs (events, loss curve,
checkpoints, progress) and never fails on what it reads: a record of an older
release or a broken entry costs its fact, and a split that still cannot be
made is returned as null numbers with the reason. `GoodputCache` serves every
view (the job JSON, Prometheus, the cluster view): a finished job's split never
changes, and a live job's is recomputed only when its record changed or its
split is older than `max_age_s`, the time since being added to its open cause
(a checkpoint stall in between shows as productive until the recompute).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any

from kuangchao.platform.jobs.goodput_facts import job_goodput as split_of
from kuangchao.platform.jobs.state import JobRecord
from kuangchao.platform.observability.goodput import CAUSES, Goodput, total

log = logging.getLogger(__name__)


def job_split(store: Any, job: JobRecord, now: float | None = None) -> Goodput | None:
    """The job's split now; None when its records cannot be split (logged)."""
    now = time.time() if now is None else now
    try:
        return split_of(job, store.events(job.id), store.metrics(job.id),
                        store.checkpoints(job.id), store.progress(job.id), now)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        log.warning("job %s: goodput not computed: %s", job.id, exc)
        return None


def job_goodput(store: Any, job: JobRecord, now: float | None = None) -> dict[str, Any]:
    """The job JSON's `goodput`: the split, or null numbers and the reason.

    Through the process's cache: a job followed by polling (`kc submit --wait`, the
    console) is re-read when its record changes, or every `max_age_s`, not on every call.
    """
    now = time.time() if now is None else now
    split = cache_for(store).get(store, job, now)
    if split is not None:
        return split.to_json()
    return {"wall_s": None, "ettr": None, "productive_s": None,
            "by_cause": dict.fromkeys(CAUSES), "lost_s": None, "since": job.created_at,
            "as_of": now, "live": not job.state.is_terminal, "open_cause": None,
            "reason": "the job's records could not be split by cause (see the API log)"}


class GoodputCache:
    """Splits of many jobs, each recomputed only when needed (thread-safe).

    Args:
        max_age_s: How long a live job's split is extended rather than recomputed.
        size: Jobs kept; the least recently asked for goes first.
    """

    def __init__(self, max_age_s: float = 30.0, size: int = 4096) -> None:
        self.max_age_s, self.size = max_age_s, size
        self._splits: OrderedDict[str, tuple[int, float, Goodput]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, store: Any, job: JobRecord, now: float | None = None) -> Goodput | None:
        now = time.time() if now is None else now
        with self._lock:
            hit = self._splits.get(job.id)
            if hit is not None:
                self._splits.move_to_end(job.id)
        if hit is not None and hit[0] == job.version and (
                job.state.is_terminal or now - hit[1] < self.max_age_s):
            return hit[2].extended(now)
        split = job_split(store, job, now)
        if split is not None:
            with self._lock:
                self._splits[job.id] = (job.version, now, split)
                self._splits.move_to_end(job.id)
                while len(self._splits) > self.size:
                    self._splits.popitem(last=False)
        return split


_caches: weakref.WeakKeyDictionary[Any, GoodputCache] = weakref.WeakKeyDictionary()
_caches_lock = threading.Lock()


def cache_for(store: Any) -> GoodputCache:
    """The cache of one store object: the API's views of it (the job JSON, `/metrics`,
    the cluster view) share it, and it goes with the store."""
    with _caches_lock:
        cache = _caches.get(store)
        if cache is None:
            cache = _caches[store] = GoodputCache()
        return cache


def cluster_view(store: Any, jobs: list[JobRecord], now: float | None = None) -> dict[str, Any]:
    """`jobs`' splits summed (all, active, finished) and each job's line (`GET /v1/goodput`)."""
    now = time.time() if now is None else now
    cache = cache_for(store)
    rows, active, finished = [], [], []
    for job in jobs:
        split = cache.get(store, job, now)
        if split is None:
            continue
        (finished if job.state.is_terminal else active).append(split)
        ettr = split.ettr
        rows.append({"id": job.id, "name": job.name, "state": job.state.value,
                     "wall_s": round(split.wall_s, 3),
                     "ettr": None if ettr is None else round(ettr, 5),
                     "lost_s": round(sum(split.by_cause.values()), 3)})
    return {"all": total([*active, *finished]), "active": total(active),
            "finished": total(finished), "jobs": rows}
