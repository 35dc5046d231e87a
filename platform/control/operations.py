"""Operations on jobs shared by the REST API, the CLI and `kc train`."""

from __future__ import annotations

import bisect
import dataclasses
import os
import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kuangchao.platform.cluster import quarantine
from kuangchao.platform.cluster.overrides import OVERRIDES_INFO
from kuangchao.platform.cluster.overrides import stored as stored_overrides
from kuangchao.platform.cluster.topology import ClusterTopology
from kuangchao.platform.errors import InvalidTransition, SpecError
from kuangchao.platform.jobs import state as lifecycle
from kuangchao.platform.jobs.state import JobRecord, JobState
from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.observability.routing import routing_view
from kuangchao.platform.planning import autoplan
from kuangchao.platform.scheduling.plugins.snapshot import order_key
from kuangchao.platform.security.admission import check_paths, check_request, limits_from_json
from kuangchao.platform.settings import (
    audit_roots,
    checkpoint_roots,
    checkpoint_urls,
    data_roots,
    data_urls,
    kc_home,
)
from kuangchao.platform.spec.elastic import samples_seen
from kuangchao.platform.spec.jobspec import JobSpec, validate_spec
from kuangchao.platform.spec.model_folder import check_model_folder
from kuangchao.platform.spec.queues import QueueTable
from kuangchao.platform.spec.stored import spec_of, stored_form
from kuangchao.platform.storage.objects import probe
from kuangchao.platform.storage.urls import is_url


def new_job_id(name: str) -> str:
    slug = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:40] or "job"
    return f"{slug}-{secrets.token_hex(4)}"


def resolve_checkpoint_path(spec: JobSpec) -> JobSpec:
    """Anchor a relative `checkpoint.path` under `$KC_HOME`.

    Jobs come from the CLI, the API and `ray job submit`, each with its own
    working directory (the last one a temporary folder); one rule for all keeps
    checkpoints where `kc` and operators can find them.
    """
    spec = _expand_home(spec)
    if is_url(spec.checkpoint.path):  # an object store: the same URL from everywhere
        return spec
    path = Path(spec.checkpoint.path).expanduser()
    if path.is_absolute():
        return spec
    # A copy with the one field changed; validating the whole spec again would
    # find nothing new and cost more than the rest of a submit.
    checkpoint = spec.checkpoint.model_copy(update={"path": str(kc_home() / path)})
    return spec.model_copy(update={"checkpoint": checkpoint})


def _expand_home(spec: JobSpec) -> JobSpec:
    """`~/...` in the model folder, data and tokenizer paths, as the submitting side means
    it: the ranks read them as written, and transformers does not expand `~`."""
    def expand(section: Any, *fields: str) -> Any:
        update = {f: os.path.expanduser(v) for f in fields
                  if isinstance(v := getattr(section, f), str) and v.startswith("~")}
        return section.model_copy(update=update) if update else section

    model, data = expand(spec.model, "path", "checkpoint"), expand(spec.data, "path", "tokenizer")
    if model is spec.model and data is spec.data:
        return spec
    return spec.model_copy(update={"model": model, "data": data})


def check_queue(store: JobStore, spec: JobSpec, role: str | None = None,
                tenant: str = "default") -> None:
    """Refuse a job for a queue the cluster does not have, and, for a submitter
    of `role` (the API's callers), what its role or tenant may not ask for.

    Raises:
        SpecError: No such queue, or a path outside the roots.
        AdmissionRefused: What the role or tenant may not ask for.
    """
    table = QueueTable.from_json(store.info("queues"))
    queue = table.get(spec.task.queue)
    if queue is None:
        raise SpecError([("task.queue", f"{spec.task.queue!r} is not a queue; known queues: "
                                        f"{', '.join(table.names)}")])
    m = spec.model
    check_paths(spec.data.path, spec.checkpoint.path, data_roots(), checkpoint_roots(),
                read_paths=(("model.checkpoint" if m.type == "llama" else "model.path", m.hf_folder),
                            ("data.tokenizer", spec.data.tokenizer)),
                audit_log=spec.permission.audit_log, audit_roots=audit_roots(), data_urls=data_urls(),
                checkpoint_urls=checkpoint_urls(), local_staging=spec.checkpoint.local_staging)
    check_model_folder(spec)
    check_store(spec.checkpoint.path)
    if role is not None:
        check_request(role, tenant, spec.task.priority_value, queue.tenants, queue.name,
                      spec.fault_tolerance.max_restarts,
                      spec.data.max_bytes, limits_from_json(table.limits))


# A store that answered is asked again only after this long: a burst of submissions
# to one bucket costs one round trip, and a bucket deleted since is noticed soon.
STORE_CHECK_TTL_S = 60.0
_store_ok: dict[str, float] = {}


def check_store(url: str) -> None:
    """Refuse an object-store `checkpoint.path` whose bucket does not exist or whose
    credentials (the operator's, here) the store refuses, before anything is queued.

    Raises:
        SpecError: Naming `checkpoint.path` and what to change.
    """
    if not is_url(url) or _store_ok.get(url, 0.0) > time.monotonic():
        return
    problem = probe(url)
    if problem is not None:
        raise SpecError([("checkpoint.path", problem)])
    _store_ok[url] = time.monotonic() + STORE_CHECK_TTL_S


def resolve_auto(store: JobStore, spec: JobSpec,
                 cluster: ClusterTopology | None = None) -> tuple[JobSpec, dict[str, Any] | None]:
    """A `parallel: auto` spec as the layout the planner chose, and the plan record.

    `cluster` defaults to the registry's node view in Redis. A spec with a
    hand-written layout comes back as it is, without a plan.

    Raises:
        SpecError: When no layout fits or can run (platform/planning/autoplan.py).
    """
    if not spec.parallel.auto:
        return spec, None
    if cluster is None:
        cluster = autoplan.topology_from_view(store.info("nodes"))
    doc, plan = autoplan.resolve(spec.model_dump(mode="json"), cluster)
    return validate_spec(doc), plan


def dry_run(store: JobStore, spec: JobSpec, role: str | None = None,
            tenant: str = "default") -> dict[str, Any]:
    """What `submit` would record, without recording it: the queue, paths and the
    role's ceilings are checked and a `parallel: auto` layout is planned. Raises
    `SpecError` and `AdmissionRefused` as `submit` does."""
    spec = resolve_checkpoint_path(spec)
    check_queue(store, spec, role, tenant)
    spec, plan = resolve_auto(store, spec)
    return {"valid": True, "spec": stored_form(spec), "plan": plan}


def submit(store: JobStore, spec: JobSpec, driver: str = "scheduler",
           owner: str | None = None, tenant: str = "default",
           cluster: ClusterTopology | None = None, role: str | None = None) -> JobRecord:
    """Record a validated job as QUEUED and wake the scheduler (`prepare`, then
    `store.create`; its arguments and errors)."""
    job, _ = prepare(store, spec, driver, owner, tenant, cluster, role)
    return store.create(job)


def prepare(store: JobStore, spec: JobSpec, driver: str = "scheduler",
            owner: str | None = None, tenant: str = "default",
            cluster: ClusterTopology | None = None,
            role: str | None = None) -> tuple[JobRecord, JobSpec]:
    """The QUEUED record `submit` would store, and the spec it holds (resolved),
    checked but not stored: the API stores it with its audit record in one
    round trip.

    A `parallel: auto` spec is resolved here, on the nodes in `cluster` (default:
    the registry's view): the record holds the concrete spec and the plan.

    With `role` (the API's submitters), the role's ceilings and the queue's
    tenants apply too (platform/security/admission.py).

    Raises:
        SpecError: When the job names a queue that does not exist, a path outside
            the roots, or no layout fits an auto spec.
        AdmissionRefused: What the role or tenant may not ask for.
    """
    spec = resolve_checkpoint_path(spec)
    check_queue(store, spec, role, tenant)
    spec, plan = resolve_auto(store, spec, cluster)
    rng = spec.elastic_range
    world = rng.world_size(rng.max_replicas)  # until admitted: the most it may take
    # The record holds the resolved spec alone, not also the document the user sent: it
    # is what the job runs with (defaults filled, the auto layout chosen, the checkpoint
    # path anchored), it is what `dry_run` and the API have always shown, and the user's
    # own file stays with the user. Readers take it back typed with `spec_of`.
    job = JobRecord(
        id=new_job_id(spec.task.name), name=spec.task.name, spec=stored_form(spec),
        queue=spec.task.queue, priority=spec.task.priority_value, world_size=world,
        gpus=world * spec.parallel.gpus_per_rank, driver=driver, owner=owner,
        tenant=tenant, plan=plan)
    return job, spec


def cancel(store: JobStore, job_id: str) -> JobRecord:
    """Cancel a job. Queued jobs end at once; running ones via their controller.

    Raises:
        InvalidTransition: When the job has already finished.
    """
    job = store.get(job_id)
    if job.state.is_terminal:
        raise InvalidTransition(f"job {job_id} already finished as {job.state.value}")
    store.request_cancel(job_id)
    out = store.update(job_id, lambda j: lifecycle.cancel(j, "cancelled while queued",
                                                            only_queued=True))
    if out is None:
        store.add_event(job_id, {"type": "cancel", "message": "cancel requested"})
    return store.get(job_id)


def scale(store: JobStore, job_id: str, replicas: int) -> JobRecord:
    """Ask for an elastic job to run at `replicas` data-parallel replicas.

    The scheduler grows the job as capacity allows, or shrinks it at once;
    a queued job is admitted at that size when it fits.

    Raises:
        SpecError: When `replicas` is outside the job's elastic range or does
            not split its global batch evenly (HTTP 422, exit 2).
        InvalidTransition: When the job has finished or is not elastic (409).
    """
    job = store.get(job_id)
    if job.state.is_terminal:
        raise InvalidTransition(f"job {job_id} already finished as {job.state.value}")
    rng = spec_of(job.spec).elastic_range
    if not rng.elastic:
        raise InvalidTransition(
            f"job {job_id} is not elastic; submit it with elastic.min_replicas and "
            "elastic.max_replicas to make it resizable")
    if not rng.admissible(replicas):
        raise SpecError([("replicas", (
            f"{replicas} is not a size job {job_id} can run at; choose one of "
            f"{', '.join(map(str, sorted(rng.sizes())))} (between elastic.min_replicas "
            f"{rng.min_replicas} and elastic.max_replicas {rng.max_replicas}, splitting the "
            f"global batch of {rng.global_batch} evenly)"))])

    def ask(j: JobRecord):
        if j.state.is_terminal:
            return None
        return dataclasses.replace(j, desired_replicas=replicas), {
            "type": "scale", "message": f"asked to run at {replicas} replica(s)",
            "to_replicas": replicas}
    store.update(job_id, ask)
    store.wake_scheduler(job_id)
    return store.get(job_id)


def job_view(store: JobStore, job: JobRecord, all_jobs: list[JobRecord] | QueueOrder | None = None,
             spec: JobSpec | None = None) -> dict[str, Any]:
    """The public JSON of a job: the record plus progress and checkpoints.

    `spec`: the job's typed spec when the caller holds it (a submit), which
    spares validating the stored document again."""
    d = job.to_json()
    d.pop("version", None)
    # A job that never started has neither progress nor checkpoints to read.
    fresh = job.started_at is None and job.restarts == 0
    prog = {} if fresh else store.progress(job.id)
    spec = spec_of(job.spec) if spec is None else spec
    total = spec.training.steps
    d["progress"] = {
        "step": prog.get("step", 0),
        "total_steps": prog.get("total_steps", total),
        "loss": prog.get("loss"),
        "initial_loss": prog.get("initial_loss"),
        "tokens_per_s": prog.get("tokens_per_s"),
        # What `kc train` / `kc submit --wait` show beside the loss, and the held-out loss.
        "lr": prog.get("lr"),
        "mem_bytes": prog.get("mem_bytes"),
        "comm_share": prog.get("comm_share"),
        "eval_loss": prog.get("eval_loss"),
        "moe": routing_view(job.spec, prog),
    }
    rng = spec.elastic_range
    d["min_replicas"], d["max_replicas"] = rng.min_replicas, rng.max_replicas
    d["global_batch"] = rng.global_batch
    d["samples_seen"] = samples_seen(d["progress"]["step"] or 0, rng.global_batch)
    # Seconds per optimizer step, the median rank 0 measured (workers/runtime/context.py).
    d["measured_step_s"] = prog.get("step_s")
    d["checkpoints"] = [] if fresh else store.checkpoints(job.id)
    d["queue_position"] = (queue_position(store, job, all_jobs) if job.state is JobState.QUEUED
                           else None)
    return d


class QueueOrder:
    """The queued jobs' places, sorted once: a job's position is then a bisection,
    not a pass over every active job (the API answers many views from one)."""

    def __init__(self, jobs: list[JobRecord]) -> None:
        self.keys = sorted(order_key(j) for j in jobs if j.state is JobState.QUEUED)

    def position(self, job: JobRecord) -> int:
        return bisect.bisect_left(self.keys, order_key(job)) + 1


def queue_position(store: JobStore, job: JobRecord,
                   jobs: list[JobRecord] | QueueOrder | None = None) -> int:
    """1-based place of a queued job in the scheduler's order (priority, then arrival)."""
    if not isinstance(jobs, QueueOrder):
        jobs = QueueOrder(jobs if jobs is not None else store.list_active())
    return jobs.position(job)


def queue_view(store: JobStore) -> dict[str, Any]:
    """The queue table with each queue's GPUs in use, running and queued jobs."""
    table = QueueTable.from_json(store.info("queues"))
    jobs = store.list_active()
    out = []
    for q in table.queues:
        mine = [j for j in jobs if j.queue == q.name]
        out.append({
            "name": q.name, "guaranteed_gpus": q.guaranteed_gpus,
            "borrow_limit_gpus": q.borrow_limit_gpus,
            "limit_gpus": None if q.borrow_limit_gpus is None else int(q.limit),
            "gpus_in_use": sum(j.gpus for j in mine if j.state.holds_resources),
            "running": sum(1 for j in mine if j.state.holds_resources),
            "queued": sum(1 for j in mine if j.state is JobState.QUEUED),
            "tenants": None if q.tenants is None else list(q.tenants),
            "gpu_types": dict(q.gpu_types) or None,
        })
    return {"queues": out, "preemption": table.preemption, "policy": table.policy,
            "limits": {role: lim.to_json() for role, lim in limits_from_json(table.limits).items()}}


def node_view(store: JobStore, sees: Callable[[str], bool] = lambda _tenant: True
              ) -> dict[str, Any]:
    """The registry's last node view, with the GPUs active jobs hold on each node.

    `gpu_map` says, per GPU, which job and rank use it. A job whose tenant the
    caller may not see (`sees(tenant)` false) shows as `hidden`, without its id.
    `overrides` is what `kc node set` stored for the node (the registry's entry
    already has it applied), so an operator sees which values are theirs.
    """
    info = store.info("nodes") or {"nodes": []}
    overrides = stored_overrides(store.info(OVERRIDES_INFO))
    holders: dict[str, dict[int, tuple[JobRecord, int]]] = {}
    for job in store.list_active():
        if job.state.holds_resources:
            for p in job.placement:
                for g in p.gpus:
                    holders.setdefault(p.node, {})[g] = (job, p.rank)
    blocked = quarantine.active(store.quarantine(), time.time())
    nodes = []
    for n in info["nodes"]:
        held = holders.get(n["name"], {})
        gpu_map = []
        for g in range(n["gpus"]):
            job, rank = held.get(g, (None, None))
            shown = job is not None and sees(job.tenant)
            gpu_map.append({"gpu": g, "job": job.id if shown else None,
                            "rank": rank if shown else None,
                            "hidden": job is not None and not shown})
        nodes.append({**n, "used_gpus": sorted(held), "free_gpus": n["gpus"] - len(held),
                      "jobs": sorted({j.id for j, _ in held.values() if sees(j.tenant)}),
                      "gpu_map": gpu_map, "quarantine": blocked.get(n["name"]),
                      "overrides": overrides.get(n["name"])})
    return {"nodes": nodes, "updated_at": info.get("updated_at")}
