"""`/v1/audit`: the audit trail, for operators and admins."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query

from kuangchao.api.server.dependencies.auth import audit_log, require
from kuangchao.api.server.schemas.access import AuditList
from kuangchao.api.server.schemas.common import errors
from kuangchao.platform.security.apikeys import Principal
from kuangchao.platform.security.audit import AuditLog

router = APIRouter(prefix="/v1/audit", tags=["audit"],
                   responses=errors(401, 403, 422, 503))


@router.get("", summary="Audit records, oldest first (the newest `limit` that match)",
            response_model=AuditList)
def read_audit(_: Annotated[Principal, Depends(require("audit.read"))],
               trail: Annotated[AuditLog, Depends(audit_log)],
               job: str | None = None,
               # Far past any date, yet small enough for a Redis stream ID in milliseconds.
               since: float | None = Query(None, ge=0, le=1e15, description="unix seconds"),
               action: str | None = Query(None, max_length=100, description=(
                   "allow or deny for that decision; else an action name such as "
                   "job.cancel, or its family such as job")),
               limit: int = Query(1000, ge=1, le=100000)) -> dict[str, Any]:
    return {"records": trail.read(job=job, since=since, action=action, limit=limit)}
