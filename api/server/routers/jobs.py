"""`/v1/jobs`: submit, list, inspect, cancel; events and logs."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from kuangchao.api.server.dependencies import listing
from kuangchao.api.server.dependencies.auth import (
    allowed,
    allowed_change,
    audit,
    require,
    visible_job,
)
from kuangchao.api.server.dependencies.store import Store, active_jobs, spec_422
from kuangchao.api.server.schemas.common import errors
from kuangchao.api.server.schemas.jobs import (
    DryRunPublic,
    EventList,
    JobList,
    JobPublic,
    LogList,
    MetricPointList,
    SamplesPublic,
)
from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.control import operations as jobs
from kuangchao.platform.control.goodput import job_goodput
from kuangchao.platform.errors import AdmissionRefused, InvalidTransition, SpecError
from kuangchao.platform.placement.pools import island_problem
from kuangchao.platform.security.apikeys import Principal
from kuangchao.platform.spec.defaults import value
from kuangchao.platform.spec.jobspec import validate_spec
from kuangchao.platform.spec.text import BUNDLE_TYPE, parse_bundle, parse_spec_text

router = APIRouter(prefix="/v1/jobs", tags=["jobs"],
                   responses=errors(401, 403, 404, 409, 413, 422, 503))


Submitter = Annotated[Principal, Depends(require("job.submit"))]
Canceller = Annotated[Principal, Depends(require("job.cancel"))]
Scaler = Annotated[Principal, Depends(require("job.scale"))]
Reader = Annotated[Principal, Depends(require("job.read"))]


# Redis' integer range: LRANGE refuses a larger start.
_MAX_INDEX = 2**63 - 1
# Bodies up to this size are parsed on the event loop (tens of microseconds); a
# larger one, up to the edge's limit, in the thread pool, so that no request
# holds the loop for long.
INLINE_PARSE_BYTES = 16 << 10


def _validated(body: str, bundled: bool) -> Any:
    return validate_spec(parse_bundle(body) if bundled else parse_spec_text(body))


def _check_islands(store: Any, spec: Any) -> None:
    """Refuse a tensor-parallel group no node of the job's GPU types could ever hold:
    it would wait forever. Checked against the registry's published nodes; before
    there are any, the scheduler says why the job waits. `parallel: auto` is left
    to the planner, which sizes groups to the islands it is given."""
    if spec.parallel.auto:
        return
    view = store.info("nodes") or {}
    nodes = [NodeInfo.from_json(n) for n in view.get("nodes") or ()]
    par = spec.parallel
    problem = island_problem(nodes, spec.resources.gpu_types, par.tensor_parallel_size,
                             par.gpus_per_rank)
    if problem is not None:
        raise SpecError([problem])


@router.post("", status_code=201, summary="Submit a job: JSON or YAML, or a bundle of a YAML and "
             f"the files its extends: names (Content-Type: {BUNDLE_TYPE})",
             response_model=JobPublic, response_model_exclude_unset=True,
             responses={200: {"model": DryRunPublic, "description": "dry_run: the validated spec"}})
async def submit_job(request: Request, store: Store, who: Submitter,
                     dry_run: bool = Query(False, description="Only validate: 200 with the "
                                           "validated spec, or 422; nothing is queued")
                     ) -> dict[str, Any] | Response:
    """Validate and queue a job; `parallel: auto` is resolved to the planner's layout here."""
    body = (await request.body()).decode("utf-8", errors="replace")
    bundled = request.headers.get("content-type", "").startswith(BUNDLE_TYPE)
    try:
        spec = (_validated(body, bundled) if len(body) <= INLINE_PARSE_BYTES
                else await run_in_threadpool(_validated, body, bundled))
        _check_islands(store, spec)
        if dry_run:  # a 200 of its own shape: it bypasses the 201's response model
            checked = DryRunPublic.model_validate(await run_in_threadpool(
                jobs.dry_run, store, spec, role=who.role, tenant=who.tenant))
            return Response(checked.model_dump_json(), media_type="application/json")
        if spec.parallel.auto:  # the planner resolves it; its search runs off the event loop
            job, spec = await run_in_threadpool(jobs.prepare, store, spec, owner=who.name,
                                                tenant=who.tenant, role=who.role)
        else:
            job, spec = jobs.prepare(store, spec, owner=who.name, tenant=who.tenant, role=who.role)
    except AdmissionRefused as exc:
        audit(store, who, "job.submit", "jobs", "deny", exc.message.replace("\n", "; "))
        raise HTTPException(status_code=403, detail=exc.message.replace("\n", "; ")) from None
    except SpecError as exc:
        raise spec_422(exc) from None
    # The record, its first event, the scheduler's wake-up and the audit record:
    # one Redis transaction, one round trip.
    job = allowed_change(store, who, "job.submit", f"job/{job.id}",
                         lambda line: store.create(job, audit_line=line), job=job,
                         queue=job.queue)
    listing.changed()
    # Serialized here, not through the response model: the view is the model's
    # shape (tests/unit/test_api_schema.py holds it to it), and validating it
    # again cost a tenth of a submit.
    return Response(json.dumps(jobs.job_view(store, job, active_jobs(store), spec=spec)),
                    status_code=201, media_type="application/json")


@router.get("", summary="List the jobs the caller's tenant may see: the newest page, "
            "oldest first; `next_cursor` gives the page before", response_model=JobList,
            response_model_exclude_unset=True)
def list_jobs(store: Store, who: Reader,
              limit: int = Query(200, ge=1, le=10000, description="the most jobs on the page"),
              cursor: str | None = Query(None, max_length=200, description=(
                  "the previous page's `next_cursor`: the jobs just older than it"))) -> Response:
    """The console polls this from every open tab: the answer is cached for
    `listing.POLL_TTL_S` per tenant scope (api/server/dependencies/listing.py)."""
    pos = listing.decode_cursor(cursor)

    def build() -> bytes:
        active = active_jobs(store)  # queue positions count every waiting job, however old
        page, after = listing.visible_page(store, who, limit, pos)
        doc = {"jobs": [jobs.job_view(store, j, active) for j in page],
               "next_cursor": listing.encode_cursor(after)}
        return JobList.model_validate(doc).model_dump_json(exclude_unset=True).encode()

    return listing.polled(("jobs", listing.scope_of(who), limit, cursor), build)


def visible_jobs(store: Any, who: Principal, limit: int) -> list[Any]:
    """The caller's newest `limit` jobs, oldest first (a listing's first page)."""
    return listing.visible_page(store, who, limit)[0]


@router.get("/{job_id}", summary="One job, with where its time went (`goodput`)",
            response_model=JobPublic, response_model_exclude_unset=True)
def get_job(job_id: str, store: Store, who: Reader) -> dict[str, Any]:
    job = visible_job(store, who, job_id, "job.read")
    return {**jobs.job_view(store, job, active_jobs(store)), "goodput": job_goodput(store, job)}


@router.post("/{job_id}/cancel", summary="Cancel a job", response_model=JobPublic,
             response_model_exclude_unset=True)
def cancel_job(job_id: str, store: Store, who: Canceller) -> dict[str, Any]:
    visible_job(store, who, job_id, "job.cancel")
    try:
        job = jobs.cancel(store, job_id)
    except InvalidTransition as exc:
        audit(store, who, "job.cancel", f"job/{job_id}", "deny", exc.message, job=job_id)
        raise HTTPException(status_code=409, detail=exc.message) from None
    allowed(store, who, "job.cancel", f"job/{job_id}", job=job_id)
    listing.changed()
    return jobs.job_view(store, job)


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    replicas: int = Field(ge=1, description="data-parallel replicas to run at")


@router.patch("/{job_id}", summary="Resize an elastic job: {\"replicas\": N}",
              response_model=JobPublic, response_model_exclude_unset=True)
def patch_job(job_id: str, body: ScaleRequest, store: Store, who: Scaler) -> dict[str, Any]:
    visible_job(store, who, job_id, "job.scale")
    try:
        job = jobs.scale(store, job_id, body.replicas)
    except SpecError as exc:
        raise spec_422(exc) from None
    except InvalidTransition as exc:
        raise HTTPException(status_code=409, detail=exc.message) from None
    allowed(store, who, "job.scale", f"job/{job_id}", job=job_id, replicas=body.replicas)
    listing.changed()
    return jobs.job_view(store, job)


@router.get("/{job_id}/samples", summary="The job's sample record (data.record_samples)",
            response_model=SamplesPublic)
def job_samples(job_id: str, store: Store, who: Reader) -> dict[str, Any]:
    job = visible_job(store, who, job_id, "job.read")
    return {"record_samples": bool(value(job.spec, "data", "record_samples")),
            "samples": store.samples(job_id)}


@router.get("/{job_id}/events", summary="The job's events, oldest first",
            response_model=EventList, response_model_exclude_unset=True)
def job_events(job_id: str, store: Store, who: Reader,
               start: int = Query(0, ge=0, le=_MAX_INDEX)) -> dict[str, Any]:
    """Events `{ts, type, ...}` from `start` on; `next` is where the next call starts."""
    return _page("events", store.events, store, who, job_id, start)


@router.get("/{job_id}/metrics", summary="The loss curve: one point per logged step, oldest first",
            response_model=MetricPointList, response_model_exclude_unset=True)
def job_metrics(job_id: str, store: Store, who: Reader,
                start: int = Query(0, ge=0, le=_MAX_INDEX)) -> dict[str, Any]:
    """Points `{step, ts, loss, tokens_per_s, step_s, ...}` from `start` on; `next` is
    where the next call starts. Steps replayed after a recovery come again."""
    return _page("points", store.metrics, store, who, job_id, start)


def _page(key: str, read: Callable[[str, int], list[dict[str, Any]]], store: Any, who: Any,
          job_id: str, start: int) -> dict[str, Any]:
    """A stream's entries from `start` on, for a caller who may read the job."""
    visible_job(store, who, job_id, "job.read")
    entries = read(job_id, start)
    return {key: entries, "next": start + len(entries)}


@router.get("/{job_id}/logs", summary="The job's log lines from every rank",
            response_model=LogList, response_model_exclude_unset=True)
def job_logs(job_id: str, store: Store, who: Reader,
             start: int = Query(0, ge=0, le=_MAX_INDEX),
             rank: int | None = Query(None, ge=0, le=1_000_000,
                                      description="Only this rank's lines"),
             module: str | None = Query(None, max_length=64,
                                        description="Only lines of this module (train, worker, "
                                                    "stdout, stderr, heartbeat, ...)")
             ) -> dict[str, Any]:
    """Lines from `start` on; `next` is where the next call starts, filters or not."""
    visible_job(store, who, job_id, "job.read")
    logs = store.logs(job_id, start)
    picked = [line for line in logs if (rank is None or line.get("rank") == rank)
              and (module is None or line.get("module") == module)]
    return {"logs": picked, "next": start + len(logs)}
