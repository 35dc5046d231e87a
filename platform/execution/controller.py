"""The per-job controller: turns a placed job into running ranks and watches them.

It makes the placement group from the plan (bundles pinned to nodes with
`bundle_label_selector`), starts one worker actor per rank in plan order,
forms the process group, runs the train function and records every step in
the job's state and events. It runs as a Ray actor for scheduled jobs and
in-process for `kc train`.
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import ray
import redis
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import (
    PlacementGroupSchedulingStrategy,
)
from torch.distributed import TCPStore

from kuangchao.platform.errors import Cancelled, KuangchaoError, Preempted, WorkerLost
from kuangchao.platform.execution.bundles import pinned_nodes, rank_resources, replica_pg
from kuangchao.platform.execution.grants import Credentials, worker_settings
from kuangchao.platform.execution.inplace import InPlaceRecovery, node_lost
from kuangchao.platform.execution.recovery import Failure, record_failure, requeue_for_recovery
from kuangchao.platform.execution.reports import apply_reports
from kuangchao.platform.execution.resize import LiveResize
from kuangchao.platform.execution.watch import RankHost, RankWatch
from kuangchao.platform.jobs.state import (
    Change,
    JobRecord,
    JobState,
    PlacedRank,
    cancel,
    fail,
    finish,
    requeue,
    start,
)
from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.scheduling.orphans import LAUNCHING, controller_name
from kuangchao.platform.settings import Settings
from kuangchao.platform.spec.elastic import ElasticRange
from kuangchao.platform.spec.jobspec import JobSpec, validate_spec
from kuangchao.workers.checkpoint.manager import verify
from kuangchao.workers.elastic.generation import Generation
from kuangchao.workers.errors import CheckpointError, WorkerError
from kuangchao.workers.runtime.worker import TrainWorker

PG_READY_TIMEOUT_S = 180.0
RENDEZVOUS_TIMEOUT_S = 300.0
PREEMPT_GRACE_S = 120.0


def _cause(exc: BaseException) -> str:
    """The message of the error a worker raised, without Ray's wrapping."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, WorkerError | KuangchaoError):
        return cause.message
    if isinstance(exc, ray.exceptions.RayActorError):
        return f"a worker process died: {exc}"
    return f"{type(exc).__name__}: {exc}"


class JobController(InPlaceRecovery, LiveResize, Credentials):
    """Runs one job from PLACING to a terminal state.

    Args:
        job_id: A job in PLACING with a placement plan.
        settings: Redis and Ray settings.
        store: The job store (opened from settings when omitted).
        poll_s: How often the watch loop checks heartbeats and requests.
        name: This controller's name (its Ray actor's), to tell a restart of
            the same controller from a new one.
        authority: The token authority's actor (default: the control plane's).
    """

    def __init__(self, job_id: str, settings: Settings, store: JobStore | None = None,
                 poll_s: float = 0.5, name: str = "driver", authority: Any = None) -> None:
        self.job_id, self.settings, self.poll_s = job_id, settings, poll_s
        self.store = store or JobStore.from_url(settings.redis_url, settings.redis_prefix)
        self.name = name
        self.pgs: list[Any] = []  # one placement group per data-parallel replica
        self.rpr = 1  # ranks per replica
        self.world = 0
        self.gen = 0  # the process-group generation last published
        self.kv: Any = None  # the rendezvous store this controller hosts for every generation
        self.spec_range: ElasticRange | None = None
        self.live_mode = False
        self.workers: list[Any] = []
        self.infos: list[dict[str, Any]] = []
        self.bundles: list[dict[str, float]] = []
        self.planned: list[tuple[int, ...] | None] = []
        self.refs: list[Any] = []
        self.spares: dict[str, Any] = {}  # node id -> a warm SpareWorker there
        self.backend = ""
        self.watch: RankWatch | None = None
        self.authority = authority
        self.fresh_grants: dict[int, dict[str, Any]] = {}

    def run(self) -> str:
        """Drive the job to its end; returns the final state's name."""
        job = self.store.get(self.job_id)
        if job.state.is_terminal:
            return job.state.value
        spec = None
        try:
            spec = validate_spec(job.spec)
            if self._took_over(job):
                self._handle_lost(Failure("controller", "the job controller restarted; its "
                                          "workers died with it"), spec)
                return self.store.get(self.job_id).state.value
            self._start(job, spec)
            result = self._watch_and_recover(spec)
            self._finish(spec, result)
        except WorkerLost as exc:
            assert spec is not None
            self._handle_lost(exc.failure, spec)
        except Cancelled:
            self._teardown()
            self._apply(cancel, "cancelled on request")
        except Preempted as exc:
            self._teardown()
            req = self.resize_by_restart
            self._requeue(exc.message if req is None else
                          f"resizing to {req['to']} replica(s) by a restart ({req.get('cause')}): "
                          "checkpointed; the scheduler places it again")
        except Exception as exc:
            if not isinstance(exc, KuangchaoError | ray.exceptions.RayError):
                # A bug of ours, not the job's: keep the traceback for the report.
                self.store.add_logs(self.job_id, [{
                    "ts": time.time(), "level": "ERROR", "job_id": self.job_id, "rank": None,
                    "module": "controller", "message": traceback.format_exc()}])
            self._teardown()
            self._apply(fail, _cause(exc))
        finally:
            self._teardown()
            self._retire_credentials()
        return self.store.get(self.job_id).state.value

    def _took_over(self, job: JobRecord) -> bool:
        """Claim the job; True when an earlier run of this same controller died mid-job.

        Ray restarts a dead controller actor under the same name and runs
        `run` again. Its workers and placement group died with it (they are
        owned by it), so the job can only be recovered, not re-attached.
        """
        ident = f"{self.name}/{os.getpid()}"
        previous = self.store.claim_controller(self.job_id, ident)
        if previous is None or previous == ident or previous.endswith("/" + LAUNCHING):
            return False
        return controller_name(previous) == self.name and job.state in (JobState.RUNNING, JobState.RECOVERING,
                                                         JobState.RESIZING, JobState.PLACING)

    def _handle_lost(self, failure: Failure, spec: JobSpec) -> None:
        """Tear down, record the failure and send the job back to be placed again."""
        t0 = time.monotonic()
        self._teardown()
        teardown_s = time.monotonic() - t0
        job = self.store.get(self.job_id)
        if job.state.is_terminal:
            return
        if job.state is JobState.RECOVERING:  # already recorded (in-place attempt, or restart)
            requeue_for_recovery(self.store, self.job_id, teardown_s)
            return
        if record_failure(self.store, self.job_id, failure, spec.fault_tolerance.max_restarts,
                          self.settings.quarantine):
            requeue_for_recovery(self.store, self.job_id, teardown_s)

    # -- phases ------------------------------------------------------------
    def _start(self, job: JobRecord, spec: JobSpec) -> None:
        self.spec_range = spec.elastic_range
        self.live_mode = spec.live_resize
        self.rpr = self.spec_range.ranks_per_replica
        self.gen = max(self.gen, int((self.store.generation(self.job_id) or {}).get("gen", 0)))
        self.world = len(job.placement)
        pinned = pinned_nodes()
        self.bundles = [rank_resources(spec, p, pinned) for p in job.placement]
        self.planned = [p.gpus if p.node_id in pinned else None for p in job.placement]
        self.pgs = [self._replica_pg(list(job.placement[r:r + self.rpr]), self.bundles[r:r + self.rpr])
                    for r in range(0, self.world, self.rpr)]
        self._await_pgs(self.pgs)
        self.fresh_grants = self._grants(list(range(self.world)))
        self.workers = [self._spawn(r, slot.node, spec) for r, slot in enumerate(job.placement)]
        infos = self._wait_ready([w.describe.remote() for w in self.workers], 300.0, "workers")
        self._record_workers(job, infos)
        self._form_group(spec, infos)
        self._apply(start,
                  f"{self.world} rank(s) joined the {self.backend} process group")
        self._note_placed()
        self._start_spares(spec)

    def _replica_pg(self, slots: list[PlacedRank], bundles: list[dict[str, float]]) -> Any:
        return replica_pg(self.job_id, slots, bundles)

    def _await_pgs(self, pgs: list[Any], timeout_s: float = PG_READY_TIMEOUT_S) -> None:
        if not pgs:
            return
        try:
            self._wait_ready([pg.ready() for pg in pgs], timeout_s, "placement group")
        except KuangchaoError as exc:
            # A node that vanished after the plan was made: place the job again.
            if isinstance(exc, Cancelled | WorkerLost):
                raise
            raise WorkerLost(Failure("placement", exc.message)) from None

    def _spawn(self, rank: int, node: str, spec: JobSpec) -> Any:
        """Start the actor of one rank in its bundle of the placement group."""
        # Granted in one batch at start; one at a time for replacements and new ranks
        # (a rank's earlier token may have been renewed, hence revoked, meanwhile).
        grant = self.fresh_grants.pop(rank, None) or self._grants([rank])[rank]
        bundle = self.bundles[rank]
        ft = spec.fault_tolerance
        custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        return ray.remote(TrainWorker).options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), resources=custom,
            max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pgs[rank // self.rpr], placement_group_bundle_index=rank % self.rpr),
        ).remote(self.job_id, rank, self.world, worker_settings(self.settings, grant),
                 self.planned[rank], node, (ft.heartbeat_interval_s, ft.heartbeat_timeout_s),
                 grant, self.authority)

    def _form_group(self, spec: JobSpec, infos: list[dict[str, Any]]) -> None:
        """Watch heartbeats from here on, and form the process group at a fresh rendezvous."""
        self._watch_ranks(spec, infos)
        gen = self._publish(self.world, {r: r for r in range(self.world)}, (), "start",
                            signal=False)
        backends = self._wait_ready(
            [w.join.remote(gen.to_json(), r, RENDEZVOUS_TIMEOUT_S) for r, w in enumerate(self.workers)],
            RENDEZVOUS_TIMEOUT_S + 30, "process group")
        self.backend = backends[0]

    def _watch_ranks(self, spec: JobSpec, infos: list[dict[str, Any]]) -> None:
        ft = spec.fault_tolerance
        self.infos = infos
        self.watch = RankWatch(
            self.store, self.job_id, list(range(len(infos))), ft.heartbeat_timeout_s,
            ft.hang_timeout_s, ft.heartbeat_interval_s,
            hosts={r: RankHost(i["pid"], i["ip"], i["host"]) for r, i in enumerate(infos)})

    def _publish(self, world: int, ranks: dict[int, int], joining: tuple[int, ...], cause: str,
                 signal: bool) -> Generation:
        """Publish the next process-group generation, at the rendezvous this controller hosts.

        Every generation meets under its own key prefix of one long-lived
        store, so a slow rank of an old generation can never join a new one.
        """
        if self.kv is None:
            self.kv = TCPStore(ray.util.get_node_ip_address(), 0, is_master=True,
                               wait_for_workers=False, timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
        rng = self.spec_range
        replicas = world // rng.ranks_per_replica
        self.gen += 1
        gen = Generation(gen=self.gen, world_size=world, replicas=replicas,
                         accum=rng.accumulation(replicas), host=ray.util.get_node_ip_address(),
                         port=int(self.kv.port), ranks=ranks, joining=joining, cause=cause)
        self.store.publish_generation(self.job_id, gen.to_json(), signal)
        return gen

    def _note_placed(self) -> None:
        """After a recovery, record how long re-placement took (requeue to RUNNING)."""
        job = self.store.get(self.job_id)
        last = job.restart_log[-1] if job.restart_log else None
        if last and "requeued_at" in last and "placement_s" not in last:
            self.store.annotate_restart(
                self.job_id, {"placement_s": round(time.time() - last["requeued_at"], 3)})

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

    def _watch_and_recover(self, spec: JobSpec) -> list[dict[str, Any]]:
        """Watch the ranks; after a rank dies, replace it in place, or for an elastic job
        re-form the group around the survivors."""
        doc = spec.model_dump(mode="json")
        self.refs = [w.run.remote(doc) for w in self.workers]
        while True:
            try:
                return self._follow(spec)
            except WorkerLost as exc:
                if self.live:
                    if not self._resize_after_loss(exc.failure, spec):
                        raise
                elif self._replace_in_place(exc.failure, spec):
                    self.refs = [w.run.remote(doc) for w in self.workers]
                else:
                    raise

    @property
    def live(self) -> bool:
        """Whether resizes and lost ranks keep the survivors' processes and state."""
        return bool(self.spec_range and self.spec_range.elastic and self.live_mode)

    def _follow(self, spec: JobSpec) -> list[dict[str, Any]]:
        """Wait for every rank's `run` (in `self.refs`, which a live resize may change)."""
        results: dict[int, Any] = {}
        preempt_deadline: float | None = None
        while True:
            pending = [ref for r, ref in enumerate(self.refs) if r not in results]
            if not pending:
                break
            # One ready result is enough to act on: a dead rank is seen at once.
            ready, _ = ray.wait(pending, num_returns=1, timeout=self.poll_s)
            for ref in ready:
                rank = self.refs.index(ref)
                try:
                    results[rank] = ray.get(ref)  # raises the worker's error
                except ray.exceptions.RayActorError as exc:
                    raise WorkerLost(self._died(rank, exc)) from None
                except Exception:
                    # Survivors of a dead peer fail in their collectives first;
                    # blame the dead rank, which is what recovery must replace.
                    dead = self._dead_ranks()
                    if dead:
                        raise WorkerLost(self._died(*dead[0])) from None
                    raise
            if len(results) == len(self.refs):
                break
            self._check_heartbeats(skip=set(results))
            try:
                apply_reports(self.store, self.job_id, spec.fault_tolerance.max_restarts)
                if self.store.cancel_requested(self.job_id):
                    raise Cancelled("cancelled")
                if preempt_deadline is None and self.store.preempt_requested(self.job_id):
                    preempt_deadline = time.monotonic() + PREEMPT_GRACE_S
                if not results and self.store.resize_requested(self.job_id):
                    self._resize_on_request(spec)
            except redis.RedisError:
                pass  # Redis away: the heartbeat watch holds its verdicts; training goes on
            if preempt_deadline is not None and time.monotonic() > preempt_deadline:
                raise Preempted(f"preempted; workers did not checkpoint within {PREEMPT_GRACE_S:.0f}s "
                                "and were stopped")
        try:  # the reports of the last steps
            apply_reports(self.store, self.job_id, spec.fault_tolerance.max_restarts)
        except redis.RedisError:
            pass  # bookkeeping: the job's outcome does not wait on it
        out = [results[i] for i in range(len(self.refs))]
        if out and isinstance(out[0], dict) and out[0].get("preempted"):
            raise Preempted(f"preempted at step {out[0].get('steps')}; checkpointed and requeued")
        return out

    def _check_heartbeats(self, skip: set[int]) -> None:
        """Turn heartbeat verdicts into a failure, with stacks for the record.

        Ranks in `skip` have already returned from their train function.
        """
        if self.watch is None:
            return
        verdicts = [v for v in self.watch.poll() if v.rank not in skip]
        if not verdicts:
            return
        first = min(verdicts, key=lambda v: (v.kind != "expired", v.rank))
        failed_at = time.time()
        ft_timeout = self.watch.classifier.heartbeat_timeout_s
        stacks = self.watch.collect_stacks([v.rank for v in verdicts])
        for rank, text in sorted(stacks.items()):
            self.store.add_event(self.job_id, {"type": "stacks", "rank": rank,
                                               "message": f"stacks of rank {rank}", "text": text})
        message = first.describe(ft_timeout)
        outside = stacks.get(first.rank, "")
        if "stopped" in outside:
            message += "; its process is stopped"
        slot = self._slot(first.rank)
        beat = first.last
        kind = first.kind
        if kind == "expired" and slot and node_lost(slot.node_id):
            kind, message = "node_lost", message + "; its node is gone"
        raise WorkerLost(Failure(
            kind, message, rank=first.rank, node=slot.node if slot else None,
            pid=slot.pid if slot else None, detected_after_s=round(first.detected_after_s, 3),
            last_heartbeat_at=beat.ts if beat else None, failed_at=failed_at,
            node_id=slot.node_id if slot else None))

    def _finish(self, spec: JobSpec, results: list[dict[str, Any]]) -> None:
        ckpt = (results[0] or {}).get("checkpoint") if results else None
        path = Path(ckpt["path"]) if ckpt else None
        if path is None:
            from kuangchao.workers.checkpoint.manager import CheckpointManager
            mgr = CheckpointManager(spec.checkpoint.path, self.job_id, 0, 1, "")
            latest = mgr.latest_verified()
            path = latest[0] if latest else None
        if path is None:
            raise KuangchaoError("the train function returned without saving a checkpoint; "
                                 "call ctx.checkpoint.save(...) before returning")
        try:
            manifest = verify(self._within_job(path))
        except CheckpointError as exc:
            raise KuangchaoError(f"final checkpoint does not verify: {exc.message}") from None
        final_loss = (results[0] or {}).get("final_loss")
        self._apply(finish,
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

    def _slot(self, rank: int) -> PlacedRank | None:
        try:
            job = self.store.get(self.job_id)
        except redis.RedisError:
            return None
        return next((p for p in job.placement if p.rank == rank), None)

    def _died(self, rank: int, exc: BaseException) -> Failure:
        """The failure of a rank whose actor died: its process, or its whole node."""
        now = time.time()  # the moment the death was seen, before any classification
        slot = self._slot(rank)
        place = f" on {slot.node} (pid {slot.pid})" if slot else ""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        kind = "node_lost" if slot and node_lost(slot.node_id) else "died"
        beat = self.watch.last_beat(rank) if self.watch else None
        return Failure(kind, f"rank {rank}{place} died: {first}", rank=rank,
                       node=slot.node if slot else None, pid=slot.pid if slot else None,
                       detected_after_s=round(now - beat.ts, 3) if beat else None,
                       last_heartbeat_at=beat.ts if beat else None, failed_at=now,
                       node_id=slot.node_id if slot else None)

    def _requeue(self, reason: str) -> None:
        """Give the GPUs back and return the job to the queue; it resumes from its checkpoint."""
        self.store.update(self.job_id, lambda j: requeue(j, reason, preemptions=j.preemptions + 1,
                                                         resize=None))
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
            raise WorkerLost(Failure("died", f"a worker died while the {what} was starting: "
                                             f"{first}")) from None
        return values[0] if single else values

    def _apply(self, operation: Callable[..., Change], reason: str) -> None:
        """Apply one of the state machine's operations to the job (a no-op where it does not apply)."""
        self.store.update(self.job_id, lambda j: operation(j, reason))

    def _teardown(self) -> None:
        for w in [*self.workers, *self.spares.values()]:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass
        self.workers, self.spares = [], {}
        self.watch = None
        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        self.pgs = []
        self.kv = None  # closes the rendezvous this controller hosted
