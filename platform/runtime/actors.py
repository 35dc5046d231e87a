"""The Ray actors of the control plane: thin shells around plain classes.

All are detached and live in the `kuangchao` namespace, pinned to the head
node when one is labelled `kc.io/role=head`:

    kc-registry         Registry: node view from Ray, published to Redis
    kc-token-authority  TokenAuthority: capability tokens and job Redis users
    kc-scheduler        SchedulerService: the scheduling loop
    kc-job-{id}         JobControllerActor: one per scheduled job
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kuangchao.platform.cluster.registry import Registry, head_node_id
from kuangchao.platform.errors import JobNotFound
from kuangchao.platform.execution.controller import JobController
from kuangchao.platform.execution.keeper import sweep_keepers
from kuangchao.platform.jobs.claims import LAUNCHING, claim
from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.observability.logjson import use_json_logs
from kuangchao.platform.runtime.authority_actor import TokenAuthorityActor
from kuangchao.platform.runtime.ray_connect import CONTROL_RESOURCE
from kuangchao.platform.scheduling.orphans import RECONCILE_S, OrphanCheck
from kuangchao.platform.scheduling.retention import RetentionSweep
from kuangchao.platform.scheduling.scheduler import Scheduler
from kuangchao.platform.security.audit import default_trail
from kuangchao.platform.security.authority import AUTHORITY_NAME, load_signing_key
from kuangchao.platform.settings import RAY_NAMESPACE, Settings
from kuangchao.platform.storage.access import apply_operator_env

log = logging.getLogger(__name__)

REGISTRY_NAME = "kc-registry"
SCHEDULER_NAME = "kc-scheduler"
# How often Ray brings a dead control-plane actor back. They keep their state
# in Redis, so a restart loses nothing; -1 would hide a crash loop forever.
CONTROL_RESTARTS = 10


def _control_options(name: str) -> dict[str, Any]:
    opts: dict[str, Any] = {"name": name, "namespace": RAY_NAMESPACE, "lifetime": "detached",
                            "num_cpus": 0, "max_concurrency": 8}
    if ray.cluster_resources().get(CONTROL_RESOURCE):
        # A Ray cluster started without kuangchao's head (a plain `ray start`
        # under `kc train`) has none; there the head affinity alone places them.
        opts["resources"] = {CONTROL_RESOURCE: 1}
    head = head_node_id(ray.nodes())
    if head:
        # Hard affinity: Ray does not reliably honour a soft one for detached
        # actors (seen on 2.60), and a controller on a worker node would die
        # with that node. Without the head the cluster is gone anyway.
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(head, soft=False)
    return opts


class RegistryActor:
    def __init__(self, settings: Settings) -> None:
        use_json_logs("registry")
        self.registry = Registry(JobStore.from_url(settings.redis_url, settings.redis_prefix))

    def snapshot(self):
        return self.registry.snapshot()



class JobControllerActor:
    def __init__(self, job_id: str, settings: Settings) -> None:
        name = ray.get_runtime_context().get_actor_name() or f"kc-job-{job_id}"
        use_json_logs("controller", job_id=job_id)
        apply_operator_env(settings.object_store_env)  # final checkpoints in an object store
        self.controller = JobController(job_id, settings, name=name)
        self._ran = False
        # What Ray and torch built at import is never garbage: moving it out of
        # the collector's sight keeps full collections short during heartbeat scans.
        gc.freeze()

    def run(self) -> str:
        # Once per process: Ray lets any code call a named actor, and a second
        # loop over the same job (a rank's code calling `run` again) would
        # fight the first. Ray's restart of a dead controller is a new process.
        if self._ran:
            raise RuntimeError(f"{self.controller.job_id}: this controller already runs its job")
        self._ran = True
        try:
            return self.controller.run()
        finally:
            ray.actor.exit_actor()


def launch_controller(job_id: str, settings: Settings) -> None:
    """Start a detached controller actor for a job and set it running."""
    # A job may be placed more than once (preemption, recovery); each run gets
    # its own controller, so the name carries a run suffix.
    name = f"kc-job-{job_id}-{secrets.token_hex(3)}"
    # If the controller's process dies, Ray starts it again and re-runs `run`,
    # which finds the job mid-flight and recovers it (see JobController._took_over).
    store = JobStore.from_url(settings.redis_url, settings.redis_prefix)
    store.claim_controller(job_id, claim(name, LAUNCHING))
    actor = ray.remote(JobControllerActor).options(
        **{**_control_options(name), "max_concurrency": 2, "max_restarts": CONTROL_RESTARTS,
           "max_task_retries": CONTROL_RESTARTS}
    ).remote(job_id, settings)
    actor.run.remote()


class SchedulerService:
    """Runs scheduling cycles in a background thread until stopped."""

    def __init__(self, settings: Settings, idle_s: float = 0.5) -> None:
        use_json_logs("scheduler")
        self.settings, self.idle_s = settings, idle_s
        self.store = JobStore.from_url(settings.redis_url, settings.redis_prefix)
        self.registry = ray.get_actor(REGISTRY_NAME, namespace=RAY_NAMESPACE)
        self.scheduler = Scheduler(
            self.store,
            nodes=lambda: ray.get(self.registry.snapshot.remote()),
            launch=lambda job_id: launch_controller(job_id, settings),
        )
        self.cycles = 0
        self.orphans = OrphanCheck(self.store, self.settings, controller_exists)
        self.retention = RetentionSweep(self.store, settings.job_retention_days,
                                        default_trail(self.store))
        self._thread = threading.Thread(target=self._loop, daemon=True, name="kc-scheduler")
        self._thread.start()

    def _loop(self) -> None:
        next_reconcile = 0.0
        while True:
            try:
                self.scheduler.step()
                self.cycles += 1
                if time.monotonic() >= next_reconcile:
                    self.orphans.check()
                    sweep_keepers(self._ended)  # peer-memory keepers of ended jobs
                    if self.retention.due():
                        self.retention.sweep()  # finished jobs past KC_JOB_RETENTION_DAYS
                    next_reconcile = time.monotonic() + RECONCILE_S
            except Exception:
                log.exception("scheduling cycle failed; retrying")
                time.sleep(self.idle_s)
            try:
                self.store.wait_for_wake(self.idle_s)
            except Exception:
                time.sleep(self.idle_s)

    def _ended(self, job_id: str) -> bool:
        try:
            return self.store.get(job_id).state.is_terminal
        except JobNotFound:
            return True

    def info(self) -> dict[str, Any]:
        return {"cycles": self.cycles, "pid": os.getpid(), "redis_prefix": self.settings.redis_prefix,
                "retention_days": self.retention.days, "jobs_purged": self.retention.purged_total}
    # No `stop`: any code in the cluster may call this actor, and the loop ends
    # only with its process.


def controller_exists(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=RAY_NAMESPACE)
        return True
    except ValueError:
        return False


def start_control_plane(settings: Settings) -> None:
    """Create the registry, token authority and scheduler actors (idempotent)
    and wait until ready.

    Raises:
        ClusterError: Without a usable signing key outside dev mode (checked
            here first, so the message is not lost in an actor's failure).
    """
    load_signing_key(settings.signing_key_file, settings.dev, settings.signing_key_pem)
    # The key travels to the authority alone, as its creation argument (kept by
    # Ray's GCS for restarts, shown by no state API), never through a raylet's
    # environment or a file on the head that every worker there could read.
    pem = settings.signing_key_pem
    if pem is None and settings.signing_key_file:
        pem = Path(settings.signing_key_file).expanduser().read_text()
    keyless = dataclasses.replace(settings, signing_key_pem=None)
    restart = {"max_restarts": CONTROL_RESTARTS, "max_task_retries": CONTROL_RESTARTS}
    registry = ray.remote(RegistryActor).options(
        **_control_options(REGISTRY_NAME), **restart, get_if_exists=True).remote(keyless)
    ray.get(registry.snapshot.remote(), timeout=120)
    authority = ray.remote(TokenAuthorityActor).options(
        **_control_options(AUTHORITY_NAME), **restart, get_if_exists=True).remote(
            dataclasses.replace(settings, signing_key_pem=pem))
    ray.get(authority.info.remote(), timeout=120)
    scheduler = ray.remote(SchedulerService).options(
        **_control_options(SCHEDULER_NAME), **restart, get_if_exists=True).remote(keyless)
    ray.get(scheduler.info.remote(), timeout=120)


def find_scheduler() -> Any | None:
    """The running scheduler actor, or None when no control plane is up."""
    try:
        return ray.get_actor(SCHEDULER_NAME, namespace=RAY_NAMESPACE)
    except ValueError:
        return None


def wait_for_nodes(count: int, timeout_s: float = 120.0) -> None:
    """Block until `count` live nodes have registered with Ray."""
    deadline = time.monotonic() + timeout_s
    while sum(1 for n in ray.nodes() if n.get("Alive")) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {sum(1 for n in ray.nodes() if n.get('Alive'))} of {count} "
                               "Ray nodes joined; see the ray-*.log files under $KC_HOME/logs")
        time.sleep(0.2)
