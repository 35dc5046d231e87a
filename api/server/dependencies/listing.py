"""What the console polls: job listings by cursor, and a short cache for the
views every open tab reads every few seconds.

**Cursors.** `GET /v1/jobs` answers the caller's newest `limit` jobs (oldest
first within the page) and `next_cursor`, which names the position in the
`jobs` index (creation time, id) of the oldest job looked at. The next call
with it answers the jobs just older than that position. Positions are exact,
not offsets, so a walk sees every job once even while jobs are submitted.
A page holds at most `limit` jobs and may hold fewer (a tenant's jobs are
filtered from everyone's, and one call looks at no more than `LIST_SCAN`
entries); only `next_cursor: null` says there is nothing older.

**The cache.** A polled answer is kept, serialized, for `POLL_TTL_S` under the
route, its parameters and the caller's *scope*: the tenant, or `*` for roles
that read every tenant. Callers of one scope see the same jobs, so they may
share an answer; callers of two scopes never do. A change made through this
process (a submit, a cancel, a queue table) drops every entry, so its author
sees it in the next answer; the scheduler's changes show within POLL_TTL_S.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Callable, Hashable
from typing import Any

from fastapi import HTTPException, Response

from kuangchao.api.server.dependencies.fresh import MISSING, Fresh
from kuangchao.platform.jobs.encoding import is_job_id
from kuangchao.platform.jobs.state import JobRecord
from kuangchao.platform.security.apikeys import Principal

POLL_TTL_S = 1.0
_polled = Fresh(POLL_TTL_S, max_items=1024)

# Entries read per round trip when filtering a tenant's jobs from everyone's,
# and the most one call reads before answering with what it found.
LIST_PAGE, LIST_SCAN = 500, 100_000

Position = tuple[float, str]


def scope_of(who: Principal) -> str:
    """Whose jobs `who` sees: every tenant's (`*`) or one tenant's."""
    return "*" if who.can("jobs.all_tenants") else f"tenant:{who.tenant}"


def polled(key: Hashable, build: Callable[[], bytes]) -> Response:
    """The JSON answer cached under `key` (which names the caller's scope), else `build()`."""
    body = _polled.get(key)
    if body is MISSING:
        body = _polled.put(key, build())
    return Response(body, media_type="application/json")


def changed() -> None:
    """Something the polled views show was changed through this process."""
    _polled.clear()


def encode_cursor(pos: Position | None) -> str | None:
    if pos is None:
        return None
    return base64.urlsafe_b64encode(json.dumps([pos[0], pos[1]]).encode()).decode().rstrip("=")


def decode_cursor(cursor: str | None) -> Position | None:
    """The position a cursor names; 422 for one this API did not give."""
    if cursor is None:
        return None
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        ts, job_id = json.loads(raw)
        if (isinstance(ts, (int, float)) and not isinstance(ts, bool) and math.isfinite(ts)
                and isinstance(job_id, str) and is_job_id(job_id)):
            return float(ts), job_id
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError):
        pass
    raise HTTPException(status_code=422, detail=[{
        "loc": ["query", "cursor"], "field": "query.cursor",
        "msg": "not a cursor this API gave; pass the `next_cursor` of the previous page "
               "as it came, or leave it out for the newest jobs"}])


def visible_page(store: Any, who: Principal, limit: int,
                 cursor: Position | None = None) -> tuple[list[JobRecord], Position | None]:
    """Up to `limit` of the caller's jobs just older than `cursor`, oldest first,
    and the position to go on from (None: no older job). Filtered by tenant,
    then limited (the other way round, a busy tenant's jobs hid a quiet one's)."""
    everyone = who.can("jobs.all_tenants")
    want = limit + 1 if everyone else LIST_PAGE  # one more: is there an older job?
    picked: list[JobRecord] = []
    pos, scanned = cursor, 0
    while scanned < LIST_SCAN:
        batch = store.jobs_before(pos, want)
        scanned += len(batch)
        for ts, job_id, job in batch:
            if len(picked) == limit:  # an older entry exists: the page ends at `pos`
                return picked[::-1], pos
            pos = (ts, job_id)
            if job is not None and (everyone or who.sees(job.tenant)):
                picked.append(job)
        if len(batch) < want:
            return picked[::-1], None
    return picked[::-1], pos
