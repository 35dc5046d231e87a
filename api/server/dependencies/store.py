"""FastAPI dependencies: the job store, opened once per process.

Dependencies are `async`: each is a dictionary lookup or one short Redis
call, and a sync dependency would cost a hop to the thread pool per request.
"""

from __future__ import annotations

import threading
import time
from functools import lru_cache
from typing import Annotated

from fastapi import Depends, HTTPException

from kuangchao.api.server.dependencies.served import ServedStore
from kuangchao.platform.control.operations import QueueOrder
from kuangchao.platform.errors import SpecError, StoreUnavailable
from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.settings import Settings


@lru_cache(maxsize=1)
def open_store() -> JobStore:
    """The process's store (with its short cache: served.py). Raises `StoreUnavailable`."""
    s = Settings.from_env()
    return ServedStore.from_url(s.redis_url, s.redis_prefix)


async def get_store() -> JobStore:
    try:
        return open_store()
    except StoreUnavailable as exc:
        raise HTTPException(status_code=503, detail=exc.message) from None


Store = Annotated[JobStore, Depends(get_store)]

# Queue positions need every active job; reading and parsing them all on each
# request would make a submit cost grow with the queue. Views share one
# snapshot for this long: a queue position may be that stale.
ACTIVE_TTL_S = 0.5
_active: dict[str, tuple[float, QueueOrder]] = {}
_active_lock = threading.Lock()


def active_jobs(store: JobStore) -> QueueOrder:
    """The queue order of the store's active jobs, as read at most `ACTIVE_TTL_S`
    ago (what `job_view` needs for queue positions)."""
    now = time.monotonic()
    with _active_lock:
        hit = _active.get(store.p)
        if hit is not None and now - hit[0] < ACTIVE_TTL_S:
            return hit[1]
    order = QueueOrder(store.list_active())
    with _active_lock:
        _active[store.p] = (now, order)
    return order


def forget_active() -> None:
    """Drop the snapshots (a new app, in tests, reads its own store)."""
    with _active_lock:
        _active.clear()


def spec_422(exc: SpecError) -> HTTPException:
    """A `SpecError` as 422, one `{loc, msg, field}` per problem, like pydantic's own."""
    return HTTPException(status_code=422, detail=[
        {"loc": path.split(".") if path else [], "msg": msg, "field": path}
        for path, msg in exc.errors])
