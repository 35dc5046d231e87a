"""`kc train`: run a job with the calling process as the Ray driver.

This is what `ray job submit -- kc train --config job.yaml` runs. When a
kuangchao control plane is up, the job is queued there (so `kc list` shows it
and the scheduler's capacity accounting includes it) and this process waits
for admission, then runs the job controller itself. Without a control plane it
places the job on the Ray cluster directly.
"""

from __future__ import annotations

import getpass
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

# torch (the rendezvous store the controller hosts) loads with this module, before
# the driver connects to Ray: dlopen'ing libtorch once Ray's threads run can fail
# for want of static TLS ("Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so"),
# which kills the driver with its job still holding GPUs.
import torch.distributed  # noqa: F401

from kuangchao.platform.cluster.registry import nodes_from_ray
from kuangchao.platform.cluster.topology import ClusterTopology
from kuangchao.platform.control import operations as jobs
from kuangchao.platform.errors import ClusterError, DriverStopped, PlacementError
from kuangchao.platform.execution.controller import JobController
from kuangchao.platform.jobs.state import JobState, PlacedRank, admit, cancel, fail
from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.placement.solver import Infeasible, place, traffic_from_spec
from kuangchao.platform.runtime.ray_connect import connect
from kuangchao.platform.scheduling.policies import Snapshot, job_shape
from kuangchao.platform.security.audit import AuditLog, AuditRecord
from kuangchao.platform.settings import Settings, audit_file, audit_roots
from kuangchao.platform.spec.jobspec import validate_spec


def _connect_ray(settings: Settings) -> None:
    if ray.is_initialized():
        return
    try:
        connect(settings.ray_address)
    except ConnectionError as exc:
        raise ClusterError(f"cannot connect to Ray ({exc}); run `kc up`, or set RAY_ADDRESS "
                           "to a running cluster") from None


def _place_here(store: JobStore, job_id: str) -> None:
    job = store.get(job_id)
    nodes = nodes_from_ray(ray.nodes())
    active = tuple(j for j in store.list_active() if j.state.holds_resources)
    used = Snapshot(nodes=nodes, queued=(), active=active).used_gpus()
    plan = place(nodes, used, job_shape(job), traffic_from_spec(job.spec))
    if isinstance(plan, Infeasible):
        store.update(job_id, lambda j: fail(j, f"cannot place: {plan.reason}"))
        raise PlacementError(f"cannot place job {job_id}: {plan.reason}")
    placement = tuple(PlacedRank(rank=s.rank, node=s.node, node_id=s.node_id, leaf=s.leaf,
                                 gpu=s.gpus[0] if s.gpus else None, gpus=s.gpus)
                      for s in plan.slots)
    store.update(job_id, lambda j: admit(j, "placed by the driver", placement=placement))


def _wait_admitted(store: JobStore, job_id: str) -> None:
    reported = None
    while True:
        job = store.get(job_id)
        if job.state is not JobState.QUEUED:
            return
        if job.waiting_for and job.waiting_for != reported:
            print(f"{job_id}: queued, waiting for {job.waiting_for}", file=sys.stderr, flush=True)
            reported = job.waiting_for
        time.sleep(0.5)


def _cancel(store: JobStore, job_id: str, what: str) -> None:
    store.request_cancel(job_id)
    store.update(job_id, lambda j: cancel(j, f"the kc train driver got {what}"))


def _stop_handler(settings: Settings, job_id: str) -> Callable[[int, Any], None]:
    """A signal handler that records the job CANCELLED first, then unwinds.

    Ray sends SIGKILL 3 s after SIGTERM (RAY_JOB_STOP_WAIT_TIME_S), and a busy
    machine may not finish tearing down by then; the record must not be left
    RUNNING. Its own Redis client: the signal may arrive inside a call holding
    the store's connection pool. The workers die with the driver in any case
    (Ray ends the actors a driver owns), and the controller's `finally` kills
    them at once when there is time.
    """
    def handler(signum: int, _frame: Any) -> None:
        for s in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)  # a second signal must not cut the teardown short
        name = signal.Signals(signum).name
        try:
            _cancel(JobStore.from_url(settings.redis_url, settings.redis_prefix), job_id,
                    f"{name} (ray job stop)")
        finally:
            raise DriverStopped(name)
    return handler


def _ray_submission_id() -> str | None:
    """The `ray job submit` id, from the job config Ray hands the entrypoint."""
    try:
        meta = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}").get("metadata")
    except ValueError:
        return None
    return (meta or {}).get("job_submission_id")


def driver_identity() -> tuple[str, str]:
    """Who submits through `kc train`: the Ray job's submission id (or the OS
    user) and the tenant in `KC_TENANT` (default: default).

    The driver holds the cluster's own credentials, like an operator, so the
    tenant is what it says; `ray job submit` access is an operator's to give.
    """
    sub = os.environ.get("RAY_JOB_SUBMISSION_ID") or _ray_submission_id()
    owner = f"ray-job/{sub}" if sub else getpass.getuser()
    return owner, os.environ.get("KC_TENANT") or "default"


def run_as_driver(doc: dict[str, Any], settings: Settings | None = None,
                  on_submitted: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the job in `doc` to its end and return its public JSON.

    `on_submitted(job_id)` is called once the job is recorded (`kc train`
    follows its progress from there)."""
    settings = settings or Settings.from_env()
    spec = validate_spec(doc)
    store = JobStore.from_url(settings.redis_url, settings.redis_prefix)
    _connect_ray(settings)
    from kuangchao.platform.runtime.actors import find_scheduler
    from kuangchao.platform.runtime.authority_actor import private_authority

    managed = find_scheduler() is not None
    # Without a control plane, this driver's own authority (an ephemeral key
    # that dies with it) grants the job's tokens.
    authority = None if managed else private_authority(settings)
    owner, tenant = driver_identity()
    # `parallel: auto` is planned on the nodes Ray has now (the registry may not run).
    cluster = ClusterTopology("ray", nodes_from_ray(ray.nodes())) if spec.parallel.auto else None
    job = jobs.submit(store, spec, driver="external", owner=owner, tenant=tenant, cluster=cluster)
    AuditLog(store, audit_file(), audit_roots()).record(AuditRecord(
        principal=f"driver:{owner}", action="job.submit", resource=f"job/{job.id}",
        decision="allow", reason=f"kc train, tenant {tenant}", job=job.id))
    print(f"job {job.id} submitted", file=sys.stderr, flush=True)
    if on_submitted is not None:
        on_submitted(job.id)
    # `ray job stop` sends SIGTERM, then SIGKILL 3 s later (RAY_JOB_STOP_WAIT_TIME_S):
    # the workers are killed and the job recorded CANCELLED well inside that.
    # Python lets only the main thread install signal handlers: an SDK user (or a
    # benchmark) driving the job from another thread keeps the process's own
    # handlers, and stops the job through the API or `kc cancel` instead.
    stop = _stop_handler(settings, job.id)
    previous = ({s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
                if threading.current_thread() is threading.main_thread() else {})
    try:
        while True:  # a recovered or preempted job comes back to the queue: place it again
            if managed:
                _wait_admitted(store, job.id)
            else:
                _place_here(store, job.id)
            if store.get(job.id).state is JobState.PLACING:
                JobController(job.id, settings, store, authority=authority).run()
            if store.get(job.id).state is not JobState.QUEUED:
                break
    except (KeyboardInterrupt, DriverStopped) as exc:
        what = f"{exc} (ray job stop)" if isinstance(exc, DriverStopped) else "an interrupt"
        _cancel(store, job.id, what)
        print(f"job {job.id} cancelled: the driver got {what}", file=sys.stderr, flush=True)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return jobs.job_view(store, store.get(job.id))


