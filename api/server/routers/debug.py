"""`/v1/jobs/{id}/debug/...` and `/v1/jobs/{id}/profiles`: ask a running job's
ranks for a diagnosis (platform/jobs/debugreq.py), and fetch the profiler traces."""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, BinaryIO, Literal

from fastapi import APIRouter, Body, Depends, HTTPException
from fastapi.responses import FileResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from kuangchao.api.server.dependencies.auth import allowed, require, visible_job
from kuangchao.api.server.dependencies.store import Store
from kuangchao.api.server.schemas.common import errors
from kuangchao.api.server.schemas.debug import DebugReport, ProfileStarted, ProfileStatus
from kuangchao.platform.jobs import debugreq
from kuangchao.platform.jobs.state import JobRecord, JobState
from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.security.apikeys import Principal
from kuangchao.platform.settings import checkpoint_roots
from kuangchao.platform.spec.defaults import value
from kuangchao.platform.storage.access import open_filesystem
from kuangchao.platform.storage.objects import describe_failure
from kuangchao.platform.storage.urls import is_url
from kuangchao.platform.storage.urls import parse as parse_url
from kuangchao.workers.checkpoint.paths import job_folder, leads_inside, open_inside, resolves_under

router = APIRouter(prefix="/v1/jobs", tags=["debug"],
                   responses=errors(401, 403, 404, 409, 413, 422, 503))
Debugger = Annotated[Principal, Depends(require("job.debug"))]
Reader = Annotated[Principal, Depends(require("job.read"))]
_ID = re.compile(r"^[0-9a-f]{12}$")
_TRACE = re.compile(r"^rank(\d{1,6})\.json\.gz$")


MAX_WAIT_S = 120.0


class DebugAsk(BaseModel):
    model_config = ConfigDict(extra="forbid")
    step: int | None = Field(None, ge=1, description="gradient: the optimizer step to capture "
                                                     "(default: the next one; at most the job's "
                                                     "last step)")
    timeout_s: float = Field(30.0, gt=0, le=MAX_WAIT_S,
                             description="how long to wait for every rank")


class Waits:
    """How many debug waits this API process holds open, in all and per tenant.

    A wait costs no thread (it sleeps on the event loop), but each polls Redis
    and holds a connection: past these bounds a request gets 429 instead."""

    def __init__(self, total: int = 32, per_tenant: int = 4) -> None:
        self.total, self.per_tenant = total, per_tenant
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}

    def enter(self, tenant: str) -> str | None:
        """None when the wait may start, else why not."""
        with self._lock:
            if self._open.get(tenant, 0) >= self.per_tenant:
                return f"tenant {tenant} has {self.per_tenant} debug requests waiting already"
            if sum(self._open.values()) >= self.total:
                return f"this API server has {self.total} debug requests waiting already"
            self._open[tenant] = self._open.get(tenant, 0) + 1
            return None

    def leave(self, tenant: str) -> None:
        with self._lock:
            self._open[tenant] -= 1
            if not self._open[tenant]:
                del self._open[tenant]


WAITS = Waits()


class ProfileAsk(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int = Field(5, ge=1, le=500, description="optimizer steps to record on every rank")


def _running(store: JobStore, who: Principal, job_id: str, action: str) -> JobRecord:
    job = visible_job(store, who, job_id, action)
    if job.state is not JobState.RUNNING:
        raise HTTPException(409, f"job {job_id} is {job.state.value}; its ranks answer only while "
                                 "it is RUNNING")
    return job


async def _wait(store: JobStore, job: JobRecord, req_id: str, timeout_s: float) -> dict[int, dict]:
    """Every rank's answer, or those in by the deadline; sleeps on the event loop, so a
    wait holds no worker thread (forty of them used to park the whole pool)."""
    deadline = time.monotonic() + timeout_s
    while True:
        answers = store.debug_answers(job.id, req_id)
        if len(answers) >= job.world_size or time.monotonic() >= deadline:
            return answers
        await asyncio.sleep(0.2)


def _retire(store: JobStore, job_id: str, req_id: str) -> None:
    """Take the request away once answered, unless a newer one replaced it: ranks stop
    looking at it (the answers stay for an hour)."""
    store.retire_debug(job_id, req_id)


@router.post("/{job_id}/debug/{kind}", summary="Every rank's communication groups, memory, "
                                               "or gradients compared across replicas",
             response_model=DebugReport, response_model_exclude_unset=True,
             responses=errors(429))
async def debug(job_id: str, kind: Literal["comm", "memory", "gradient"], store: Store,
                who: Debugger, ask: Annotated[DebugAsk | None, Body()] = None) -> dict[str, Any]:
    """Waits for every rank (up to `timeout_s`); ranks that did not answer are listed in
    `missing`. A rank stuck in a collective still answers `comm` and `memory`."""
    ask = ask or DebugAsk()
    job = _running(store, who, job_id, f"job.debug.{kind}")
    last = int(value(job.spec, "training", "steps"))
    if ask.step is not None and ask.step > last:
        raise HTTPException(422, [{"loc": ["body", "step"], "field": "body.step", "msg": (
            f"job {job_id} trains {last} steps; ask for a step up to {last}, or none "
            "for the next one")}])
    busy = WAITS.enter(who.tenant)
    if busy is not None:
        raise HTTPException(429, f"{busy}; retry once one has answered",
                            headers={"Retry-After": "5"})
    try:
        req = store.post_debug(job_id, kind, step=ask.step)
        allowed(store, who, f"job.debug.{kind}", f"job/{job_id}", job=job_id, request=req.id)
        answers = await _wait(store, job, req.id, ask.timeout_s)
        _retire(store, job_id, req.id)
    finally:
        WAITS.leave(who.tenant)
    out: dict[str, Any] = {"job": job_id, "kind": kind, "request": req.id,
                           "missing": sorted(set(range(job.world_size)) - set(answers))}
    if kind == "comm":
        out.update(debugreq.comm_report(answers))
    elif kind == "gradient":
        out.update(debugreq.gradient_report(answers))
        out["errors"] = {r: a["error"] for r, a in answers.items() if a.get("error")}
    else:
        out["ranks"] = {r: answers[r] for r in sorted(answers)}
    return out


@router.post("/{job_id}/profiles", status_code=202,
             summary="Record a torch.profiler trace of the next `steps` steps on every rank",
             response_model=ProfileStarted)
def start_profile(job_id: str, store: Store, who: Debugger,
                  ask: Annotated[ProfileAsk | None, Body()] = None) -> dict[str, Any]:
    ask = ask or ProfileAsk()
    job = _running(store, who, job_id, "job.profile")
    req = store.post_debug(job_id, "profile", steps=ask.steps)
    allowed(store, who, "job.profile", f"job/{job_id}", job=job_id, request=req.id,
            steps=ask.steps)
    return {"job": job_id, "id": req.id, "steps": ask.steps, "ranks": job.world_size}


@router.get("/{job_id}/profiles/{profile_id}", summary="A profile's per-rank summaries and files",
            response_model=ProfileStatus)
def profile_status(job_id: str, profile_id: str, store: Store, who: Reader) -> dict[str, Any]:
    job = visible_job(store, who, job_id, "job.read")
    if not _ID.match(profile_id):
        raise HTTPException(404, f"no profile {profile_id!r} for job {job_id}")
    answers = store.debug_answers(job_id, profile_id)
    expected = job.world_size
    if len(answers) >= expected:
        _retire(store, job_id, profile_id)
    return {"job": job_id, "id": profile_id, "ranks": {r: answers[r] for r in sorted(answers)},
            "missing": sorted(set(range(expected)) - set(answers)),
            "done": len(answers) >= expected,
            "files": [f"rank{r}.json.gz" for r in sorted(answers) if not answers[r].get("error")]}


@router.get("/{job_id}/profiles/{profile_id}/{name}", summary="Download one rank's Chrome/"
            "Perfetto trace (gzip-compressed JSON)", response_class=FileResponse,
            responses={200: {"content": {"application/gzip": {
                "schema": {"type": "string", "format": "binary"}}}}})
def profile_file(job_id: str, profile_id: str, name: str, store: Store,
                 who: Reader) -> StreamingResponse:
    job = visible_job(store, who, job_id, "job.read")
    if not _ID.match(profile_id) or not _TRACE.match(name):
        raise HTTPException(404, f"no file {name!r} in profile {profile_id!r}; files are named "
                                 "rankN.json.gz")
    raw = str((job.spec.get("checkpoint") or {}).get("path") or "")
    if is_url(raw):
        return _from_store(raw, job_id, profile_id, name)
    root = Path(raw).expanduser()
    path = root / job_id / "profiles" / profile_id / name
    # The job's ranks wrote that folder: serve nothing a symlink of theirs leads to.
    folder = job_folder(root, job_id)
    if not resolves_under(folder, checkpoint_roots()):
        raise HTTPException(403, f"job {job_id}'s checkpoint folder leads outside the folders "
                                 "jobs may use here (KC_CHECKPOINT_ROOTS); its profiles are not "
                                 "served")
    if not leads_inside(path, folder):
        raise HTTPException(403, f"{name} of profile {profile_id} leads outside the job's "
                                 "checkpoint folder (a symlink); it is not served")
    try:
        fh = open_inside(path, folder)
    except PermissionError:
        raise HTTPException(403, f"{name} of profile {profile_id} is a symlink; it is not "
                                 "served") from None
    except OSError:
        raise HTTPException(404, f"{name} of profile {profile_id} is not on this server's disk "
                                 f"(looked in {path.parent}); the trace is written next to the "
                                 "job's checkpoints, which the API server must be able to read"
                            ) from None
    size = os.fstat(fh.fileno()).st_size
    return StreamingResponse(_chunks(fh), media_type="application/gzip", headers={
        "Content-Length": str(size),
        "Content-Disposition": f'attachment; filename="{job_id}-{name}"'})


def _from_store(root: str, job_id: str, profile_id: str, name: str) -> StreamingResponse:
    """A trace the ranks uploaded next to the job's checkpoints in an object store, read
    with the server's (the operator's) credentials. The object's key is built here from
    checked parts, so nothing the job wrote names another place."""
    target = parse_url(root).join(job_id, "profiles", profile_id, name)
    try:
        fs = open_filesystem(target.scheme)
        size = int(fs.info(target.path)["size"])
        fh = fs.open(target.path, "rb")
    except FileNotFoundError:
        raise HTTPException(404, f"{name} of profile {profile_id} is not in the store (looked "
                                 f"for {target}); a rank that failed to profile uploads none"
                            ) from None
    except Exception as exc:  # the store's own errors: unreachable, refused
        raise HTTPException(503, f"{name} of profile {profile_id} cannot be read from the store: "
                                 f"{describe_failure(exc, target)}") from None
    return StreamingResponse(_chunks(fh), media_type="application/gzip", headers={
        "Content-Length": str(size),
        "Content-Disposition": f'attachment; filename="{job_id}-{name}"'})


def _chunks(fh: BinaryIO, size: int = 1 << 20) -> Iterator[bytes]:
    """The open file's bytes, then it closed: what was opened is what is served."""
    with fh:
        while chunk := fh.read(size):
            yield chunk
