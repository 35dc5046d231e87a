"""`/v1/audit`: the audit trail, for operators and admins."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query

from kuangchao.api.server.dependencies.auth import audit, audit_log, require
from kuangchao.api.server.dependencies.store import Store
from kuangchao.api.server.schemas.access import AuditList
from kuangchao.api.server.schemas.common import errors
from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.security.apikeys import Principal
from kuangchao.platform.security.audit import AuditLog

router = APIRouter(prefix="/v1/audit", tags=["audit"],
                   responses=errors(401, 403, 404, 422, 503))

# How far back `task` looks for the jobs of a name (as a job listing does).
TASK_PAGE, TASK_SCAN = 500, 100_000


def task_jobs(store: JobStore, who: Principal, task: str) -> set[str]:
    """The ids of the jobs named `task` that the caller's tenant may see; 404
    when there are none, the same answer whether or not another tenant has one
    (that attempt is audited, as for a hidden job)."""
    seen: set[str] = set()
    hidden = False
    for before in range(0, TASK_SCAN, TASK_PAGE):
        page = store.list(TASK_PAGE, before=before)
        for j in page:
            if j.name == task:
                if who.sees(j.tenant):
                    seen.add(j.id)
                else:
                    hidden = True
        if len(page) < TASK_PAGE:
            break
    if not seen:
        if hidden:
            audit(store, who, "audit.read", f"task/{task}", "deny",
                  "the task's jobs belong to other tenants")
        raise HTTPException(status_code=404, detail=(
            f"no job named {task!r} that your key may see; `kc list` shows the jobs' "
            "names (a job's task.name)"))
    return seen


@router.get("", summary="Audit records, oldest first (the newest `limit` that match)",
            response_model=AuditList)
def read_audit(who: Annotated[Principal, Depends(require("audit.read"))],
               store: Store,
               trail: Annotated[AuditLog, Depends(audit_log)],
               job: str | None = None,
               task: str | None = Query(None, min_length=1, max_length=200, description=(
                   "only records about the jobs of this task name (task.name) that the "
                   "caller may see; 404 when there are none")),
               # Far past any date, yet small enough for a Redis stream ID in milliseconds.
               since: float | None = Query(None, ge=0, le=1e15, description="unix seconds"),
               action: str | None = Query(None, max_length=100, description=(
                   "allow or deny for that decision; else an action name such as "
                   "job.cancel, or its family such as job")),
               limit: int = Query(1000, ge=1, le=100000)) -> dict[str, Any]:
    jobs = task_jobs(store, who, task) if task is not None else None
    return {"records": trail.read(job=job, since=since, action=action, limit=limit,
                                  jobs=jobs)}
