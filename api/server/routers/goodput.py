"""`/v1/goodput`: where the time of the caller's jobs went, summed over them.

A job's own split is on its JSON (`GET /v1/jobs/{id}`, field `goodput`). This
view sums the newest `limit` jobs the caller may read (its tenant's, or every
tenant's for operators), finished and active apart, with a time-weighted ETTR:
productive seconds over wall-clock seconds, summed, so a long job weighs more
than a short one.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from starlette.concurrency import run_in_threadpool

from kuangchao.api.server.dependencies.auth import require
from kuangchao.api.server.dependencies.store import Store
from kuangchao.api.server.routers.jobs import visible_jobs
from kuangchao.api.server.schemas.common import errors
from kuangchao.api.server.schemas.jobs import ClusterGoodput
from kuangchao.platform.control.goodput import cluster_view
from kuangchao.platform.security.apikeys import Principal

router = APIRouter(prefix="/v1/goodput", tags=["jobs"], responses=errors(401, 403, 422, 503))
Reader = Annotated[Principal, Depends(require("job.read"))]


@router.get("", summary="Goodput summed over the caller's newest jobs (a time-weighted ETTR)",
            response_model=ClusterGoodput)
async def cluster_goodput(store: Store, who: Reader,
                          limit: int = Query(200, ge=1, le=2000)) -> dict[str, Any]:
    jobs = await run_in_threadpool(visible_jobs, store, who, limit)
    return await run_in_threadpool(cluster_view, store, jobs)
