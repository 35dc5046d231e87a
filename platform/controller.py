"""The per-job controller: turns a placed job into running ranks and watches them.

It makes the placement group from the plan (bundles pinned to nodes with
`bundle_label_selector`), starts one worker actor per rank in plan order,
forms the process group, runs the train function and records every step in
the job's state and events. It runs as a Ray actor for scheduled jobs and
in-process for `kc train`.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kuangchao.platform.errors import KuangchaoError
from kuangchao.platform.registry import nodes_from_ray
from kuangchao.platform.settings import Settings
from kuangchao.platform.spec import JobSpec, validate_spec
from kuangchao.platform.state import JobRecord, JobState, PlacedRank, transition
from kuangchao.platform.store import JobStore
from kuangchao.platform.topology import gpu_resource
from kuangchao.workers.checkpoint import verify
from kuangchao.workers.errors import CheckpointError, WorkerError
from kuangchao.workers.worker import TrainWorker

PG_READY_TIMEOUT_S = 180.0
RENDEZVOUS_TIMEOUT_S = 300.0
PREEMPT_GRACE_S = 120.0


class Cancelled(KuangchaoError):
    """The job was cancelled while the controller was working on it."""


class Preempted(KuangchaoError):
    """The scheduler took the job's GPUs back; it goes back to the queue."""


class WorkerLost(KuangchaoError):
    """A rank's process or node died: an infrastructure fault the job recovers from."""


def _pinned_nodes() -> set[str]:
    """Ray node ids whose GPUs carry one `kc_gpu_N` resource each."""
    return {n.node_id for n in nodes_from_ray(ray.nodes()) if n.pinned_gpus}


def _rank_resources(spec: JobSpec, slot: PlacedRank, pinned: set[str]) -> dict[str, float]:
    """The bundle of one rank: CPUs, GPUs and, on pinned nodes, the exact GPU ids."""
    par = spec.parallel
    bundle: dict[str, float] = {"CPU": par.cpus_per_rank}
    if par.gpus_per_rank:
        bundle["GPU"] = par.gpus_per_rank
        if slot.node_id in pinned:
            bundle.update({gpu_resource(g): 1 for g in slot.gpus})
    return bundle


def _cause(exc: BaseException) -> str:
    """The message of the error a worker raised, without Ray's wrapping."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, WorkerError | KuangchaoError):
        return cause.message
    if isinstance(exc, ray.exceptions.RayActorError):
        return f"a worker process died: {exc}"
    return f"{type(exc).__name__}: {exc}"


class JobController:
    """Runs one job from PLACING to a terminal state.

    Args:
        job_id: A job in PLACING with a placement plan.
        settings: Redis and Ray settings.
        store: The job store (opened from settings when omitted).
        poll_s: How often the watch loop checks workers and cancel requests.
    """

    def __init__(self, job_id: str, settings: Settings, store: JobStore | None = None,
                 poll_s: float = 0.5) -> None:
        self.job_id, self.settings, self.poll_s = job_id, settings, poll_s
        self.store = store or JobStore.from_url(settings.redis_url, settings.redis_prefix)
        self.pg = None
        self.workers: list[Any] = []

    def run(self) -> str:
        """Drive the job to its end; returns the final state's name."""
        job = self.store.get(self.job_id)
        if job.state.is_terminal:
            return job.state.value
        spec = None
        try:
            spec = validate_spec(job.spec)
            self._start(job, spec)
            result = self._watch(spec)
            self._finish(spec, result)
        except WorkerLost as exc:
            self._teardown()
            assert spec is not None
            self._recover(exc.message, spec.fault_tolerance.max_restarts)
        except Cancelled:
            self._teardown()
            self._set(JobState.CANCELLED, "cancelled on request")
        except Preempted as exc:
            self._teardown()
            self._requeue(exc.message)
        except Exception as exc:
            if not isinstance(exc, KuangchaoError | ray.exceptions.RayError):
                # A bug of ours, not the job's: keep the traceback for the report.
                self.store.add_logs(self.job_id, [{
                    "ts": time.time(), "level": "ERROR", "job_id": self.job_id, "rank": None,
                    "module": "controller", "message": traceback.format_exc()}])
            self._teardown()
            self._set(JobState.FAILED, _cause(exc))
        finally:
            self._teardown()
        return self.store.get(self.job_id).state.value

    # -- phases ------------------------------------------------------------
    def _start(self, job: JobRecord, spec: JobSpec) -> None:
        pinned = _pinned_nodes()
        bundles = [_rank_resources(spec, p, pinned) for p in job.placement]
        selectors = [{"ray.io/node-id": p.node_id} for p in job.placement]
        self.pg = placement_group(bundles, strategy="PACK", name=f"kc-{self.job_id}",
                                  bundle_label_selector=selectors)
        self._wait_ready(self.pg.ready(), PG_READY_TIMEOUT_S, "placement group")
        cls = ray.remote(TrainWorker)
        self.workers = []
        for r, (slot, bundle) in enumerate(zip(job.placement, bundles, strict=True)):
            custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
            planned = slot.gpus if slot.node_id in pinned else None
            self.workers.append(cls.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), resources=custom,
                max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=r),
            ).remote(self.job_id, r, spec.world_size, self.settings, planned))
        infos = self._wait_ready([w.describe.remote() for w in self.workers], 300.0, "workers")
        self._record_workers(job, infos)
        host = infos[0]["ip"]
        port = self._wait_ready(self.workers[0].open_rendezvous.remote(host), 60.0, "rendezvous")
        backends = self._wait_ready(
            [w.join.remote(host, port, RENDEZVOUS_TIMEOUT_S) for w in self.workers],
            RENDEZVOUS_TIMEOUT_S + 30, "process group")
        self._set(JobState.RUNNING,
                  f"{spec.world_size} rank(s) joined the {backends[0]} process group")

    def _record_workers(self, job: JobRecord, infos: list[dict[str, Any]]) -> None:
        for slot, info in zip(job.placement, infos, strict=True):
            if slot.node_id and info["node_id"] != slot.node_id:
                raise KuangchaoError(
                    f"rank {slot.rank} was planned on {slot.node} but Ray started it on node "
                    f"{info['node_id'][:12]}; the placement group did not honour the plan")

        def update(j: JobRecord) -> tuple[JobRecord, dict[str, Any]]:
            placement = tuple(dataclasses.replace(p, pid=i["pid"])
                              for p, i in zip(j.placement, infos, strict=True))
            message = "; ".join(
                f"rank {p.rank} on {p.node} gpus {','.join(map(str, i['gpu_ids']))} pid {p.pid}"
                for p, i in zip(placement, infos, strict=True))
            return dataclasses.replace(j, placement=placement), {"type": "placement",
                                                                 "message": message}

        self.store.update(self.job_id, update)

    def _watch(self, spec: JobSpec) -> list[dict[str, Any]]:
        refs = [w.run.remote(spec.model_dump(mode="json")) for w in self.workers]
        results: dict[int, Any] = {}
        pending = list(refs)
        preempt_deadline: float | None = None
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=self.poll_s)
            for ref in ready:
                rank = refs.index(ref)
                try:
                    results[rank] = ray.get(ref)  # raises the worker's error
                except ray.exceptions.RayActorError as exc:
                    raise WorkerLost(self._lost_message(rank, exc)) from None
                except Exception:
                    # Survivors of a dead peer fail in their collectives first;
                    # blame the dead rank, which is what recovery must replace.
                    dead = self._dead_ranks()
                    if dead:
                        raise WorkerLost(self._lost_message(*dead[0])) from None
                    raise
            if self.store.cancel_requested(self.job_id):
                raise Cancelled("cancelled")
            if preempt_deadline is None and self.store.preempt_requested(self.job_id):
                preempt_deadline = time.monotonic() + PREEMPT_GRACE_S
            if preempt_deadline is not None and pending and time.monotonic() > preempt_deadline:
                raise Preempted(f"preempted; workers did not checkpoint within {PREEMPT_GRACE_S:.0f}s "
                                "and were stopped")
        out = [results[i] for i in range(len(refs))]
        if out and isinstance(out[0], dict) and out[0].get("preempted"):
            raise Preempted(f"preempted at step {out[0].get('steps')}; checkpointed and requeued")
        return out

    def _finish(self, spec: JobSpec, results: list[dict[str, Any]]) -> None:
        ckpt = (results[0] or {}).get("checkpoint") if results else None
        path = Path(ckpt["path"]) if ckpt else None
        if path is None:
            from kuangchao.workers.checkpoint import CheckpointManager
            mgr = CheckpointManager(spec.checkpoint.path, self.job_id, 0, 1, "")
            latest = mgr.latest_verified()
            path = latest[0] if latest else None
        if path is None:
            raise KuangchaoError("the train function returned without saving a checkpoint; "
                                 "call ctx.checkpoint.save(...) before returning")
        try:
            manifest = verify(path)
        except CheckpointError as exc:
            raise KuangchaoError(f"final checkpoint does not verify: {exc.message}") from None
        final_loss = (results[0] or {}).get("final_loss")
        self._set(JobState.SUCCEEDED,
                  f"finished at step {manifest['step']}; final checkpoint {path}"
                  + (f"; final loss {final_loss:.4f}" if isinstance(final_loss, float) else ""))

    def _dead_ranks(self, timeout_s: float = 15.0) -> list[tuple[int, BaseException]]:
        """Ranks whose actor is gone. A live rank busy in `run` does not answer and
        counts as alive; a dead one's readiness check fails within seconds."""
        probes = [w.__ray_ready__.remote() for w in self.workers]
        ready, _ = ray.wait(probes, num_returns=len(probes), timeout=timeout_s)
        dead = []
        for rank, ref in enumerate(probes):
            if ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    dead.append((rank, exc))
        return dead

    def _lost_message(self, rank: int, exc: BaseException) -> str:
        job = self.store.get(self.job_id)
        where = next((p for p in job.placement if p.rank == rank), None)
        place = f" on {where.node} (pid {where.pid})" if where else ""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"rank {rank}{place} died: {first}"

    def _recover(self, cause: str, max_restarts: int) -> None:
        """Record the failure and put the job back in the queue to be re-placed.

        The scheduler places it again (other nodes allowed) and the trainer
        resumes from the newest checkpoint that verifies. After `max_restarts`
        the job fails with the last cause.
        """
        job = self.store.get(self.job_id)
        if job.state.is_terminal:
            return
        if job.restarts >= max_restarts:
            self._set(JobState.FAILED, f"{cause}; gave up after {job.restarts} restart(s) "
                                       "(fault_tolerance.max_restarts)")
            return
        record = {"cause": cause, "failed_at": time.time(), "restart": job.restarts + 1}

        def fail(j: JobRecord):
            if j.state.is_terminal:
                return None
            return transition(j, JobState.RECOVERING, cause, restarts=j.restarts + 1,
                              restart_log=(*j.restart_log, record))
        self.store.update(self.job_id, fail)
        self.store.add_event(self.job_id, {"type": "failure", "message": cause, **record})
        self.store.update(self.job_id, lambda j: None if j.state.is_terminal else transition(
            j, JobState.QUEUED, "re-placing; resumes from the newest verified checkpoint",
            placement=(), preempting_for=None))
        self.store.wake_scheduler(self.job_id)

    def _requeue(self, reason: str) -> None:
        """Give the GPUs back and return the job to the queue; it resumes from its checkpoint."""
        def back(j: JobRecord):
            if j.state.is_terminal:
                return None
            new, event = transition(j, JobState.QUEUED, reason, placement=(), preempting_for=None,
                                    preemptions=j.preemptions + 1)
            return new, event
        self.store.update(self.job_id, back)
        self.store.clear_preempt(self.job_id)
        self.store.wake_scheduler(self.job_id)

    # -- helpers -----------------------------------------------------------
    def _wait_ready(self, refs: Any, timeout_s: float, what: str) -> Any:
        single = not isinstance(refs, list)
        pending = [refs] if single else list(refs)
        deadline = time.monotonic() + timeout_s
        while True:
            _, not_ready = ray.wait(pending, num_returns=len(pending), timeout=self.poll_s)
            if not not_ready:
                break
            if self.store.cancel_requested(self.job_id):
                raise Cancelled("cancelled")
            if time.monotonic() > deadline:
                raise KuangchaoError(f"{what} not ready after {timeout_s:.0f}s; check `ray status` "
                                     "for missing nodes or resources")
        try:
            values = ray.get(pending)
        except ray.exceptions.RayActorError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else "actor died"
            raise WorkerLost(f"a worker died while the {what} was starting: {first}") from None
        return values[0] if single else values

    def _set(self, state: JobState, reason: str) -> None:
        job = self.store.get(self.job_id)
        if job.state is state or job.state.is_terminal:
            return
        self.store.transition(self.job_id, state, reason)

    def _teardown(self) -> None:
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass
        self.workers = []
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None
