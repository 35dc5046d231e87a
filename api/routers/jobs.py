"""`/v1/jobs`: submit, list, inspect, cancel; events and logs."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from kuangchao.api.deps import Store
from kuangchao.platform import jobs
from kuangchao.platform.errors import InvalidTransition, JobNotFound, SpecError
from kuangchao.platform.spec import parse_spec_text, validate_spec

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


def _spec_422(exc: SpecError) -> HTTPException:
    return HTTPException(status_code=422, detail=[
        {"loc": path.split(".") if path else [], "msg": msg, "field": path}
        for path, msg in exc.errors])


def _get(store, job_id: str):
    try:
        return store.get(job_id)
    except JobNotFound as exc:
        raise HTTPException(status_code=404, detail=exc.message) from None


@router.post("", status_code=201, summary="Submit a job (JSON or YAML body)")
async def submit_job(request: Request, store: Store) -> dict[str, Any]:
    body = (await request.body()).decode("utf-8", errors="replace")
    try:
        spec = validate_spec(parse_spec_text(body))
        job = jobs.submit(store, spec)
    except SpecError as exc:
        raise _spec_422(exc) from None
    return jobs.job_view(store, job)


@router.get("", summary="List jobs, newest last")
def list_jobs(store: Store, limit: int = Query(200, ge=1, le=10000)) -> dict[str, Any]:
    active = store.list_active()  # queue positions count every waiting job, however old
    return {"jobs": [jobs.job_view(store, j, active) for j in store.list(limit)]}


@router.get("/{job_id}", summary="One job")
def get_job(job_id: str, store: Store) -> dict[str, Any]:
    return jobs.job_view(store, _get(store, job_id))


@router.post("/{job_id}/cancel", summary="Cancel a job")
def cancel_job(job_id: str, store: Store) -> dict[str, Any]:
    _get(store, job_id)
    try:
        job = jobs.cancel(store, job_id)
    except InvalidTransition as exc:
        raise HTTPException(status_code=409, detail=exc.message) from None
    return jobs.job_view(store, job)


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    replicas: int = Field(ge=1, description="data-parallel replicas to run at")


@router.patch("/{job_id}", summary="Resize an elastic job: {\"replicas\": N}")
def patch_job(job_id: str, body: ScaleRequest, store: Store) -> dict[str, Any]:
    _get(store, job_id)
    try:
        job = jobs.scale(store, job_id, body.replicas)
    except SpecError as exc:
        raise _spec_422(exc) from None
    except InvalidTransition as exc:
        raise HTTPException(status_code=409, detail=exc.message) from None
    return jobs.job_view(store, job)


@router.get("/{job_id}/samples", summary="The job's sample record (data.record_samples)")
def job_samples(job_id: str, store: Store) -> dict[str, Any]:
    job = _get(store, job_id)
    return {"record_samples": bool(job.spec.get("data", {}).get("record_samples")),
            "samples": store.samples(job_id)}


@router.get("/{job_id}/events", summary="The job's events, oldest first")
def job_events(job_id: str, store: Store, start: int = Query(0, ge=0)) -> dict[str, Any]:
    _get(store, job_id)
    events = store.events(job_id, start)
    return {"events": events, "next": start + len(events)}


@router.get("/{job_id}/logs", summary="The job's log lines from every rank")
def job_logs(job_id: str, store: Store, start: int = Query(0, ge=0)) -> dict[str, Any]:
    _get(store, job_id)
    logs = store.logs(job_id, start)
    return {"logs": logs, "next": start + len(logs)}
