"""The per-job controller: turns a placed job into running ranks and watches them.

It composes collaborators, each along one seam: the worker group (the only
part that calls Ray: actors, placement groups, spares, the rendezvous), the
formation (generations and the heartbeat watch), the failure detector, the
pure failure policy, and the two recovery executors (in place, and live
resize). The controller itself reads the job's requests, asks the policy and
applies the state machine's named operations. It runs as a Ray actor for
scheduled jobs and in-process for `kc train`; unit tests drive it with a fake
worker group and the in-memory store.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from kuangchao.platform.errors import Cancelled, KuangchaoError, Preempted, RankFailed, WorkerLost
from kuangchao.platform.execution.detection import FailureDetector
from kuangchao.platform.execution.drain import DrainResponder
from kuangchao.platform.execution.failure_policy import Action
from kuangchao.platform.execution.formation import Formation
from kuangchao.platform.execution.inplace import InPlaceReplacement
from kuangchao.platform.execution.memory_plan import JobKeepers
from kuangchao.platform.execution.reachability import redis_address
from kuangchao.platform.execution.recovery import Failure, judge, record_failure, requeue_for_recovery
from kuangchao.platform.execution.reports import apply_reports
from kuangchao.platform.execution.resize import ResizeExecutor
from kuangchao.platform.execution.watch import RankWatch
from kuangchao.platform.jobs.claims import LAUNCHING, claim, controller_name
from kuangchao.platform.jobs.state import Change, JobRecord, JobState, cancel, fail, finish, requeue, start
from kuangchao.platform.protocol.checkpoint import job_dir, latest_verified, verify
from kuangchao.platform.settings import Settings
from kuangchao.platform.spec.jobspec import JobSpec, validate_spec
from kuangchao.platform.storage.mirror import job_checkpoints, verify_step_url
from kuangchao.platform.storage.urls import is_url
from kuangchao.workers.errors import CheckpointError

if TYPE_CHECKING:
    from kuangchao.platform.execution.grants import Credentials

PREEMPT_GRACE_S = 120.0


class JobController:
    """Runs one job from PLACING to a terminal state.

    Args:
        job_id: A job in PLACING with a placement plan.
        settings: Redis and Ray settings.
        store: The job store (opened from settings when omitted).
        poll_s: How often the watch loop checks heartbeats and requests.
        name: This controller's name (its Ray actor's), to tell a restart of
            the same controller from a new one.
        authority: The token authority's actor (default: the control plane's).
        group: The worker group (default: Ray's).
        watch_factory: Builds the heartbeat watch (default: `RankWatch`).
        credentials: The job's credentials (default: from the authority).
        latest_checkpoint: The newest verified checkpoint of a spec's folder, for a
            train function that returns without naming one.
    """

    def __init__(self, job_id: str, settings: Settings, store: Any = None, poll_s: float = 0.5,
                 name: str = "driver", authority: Any = None, group: Any = None,
                 watch_factory: Callable[..., Any] = RankWatch,
                 credentials: Credentials | None = None,
                 latest_checkpoint: Callable[[JobSpec, str], Path | str | None] | None = None,
                 ) -> None:
        if store is None:
            from kuangchao.platform.jobs.store import JobStore

            store = JobStore.from_url(settings.redis_url, settings.redis_prefix)
        self.job_id, self.settings, self.poll_s, self.store, self.name = (
            job_id, settings, poll_s, store, name)
        if credentials is None or group is None:  # the Ray shells, loaded only when used
            from kuangchao.platform.execution.grants import Credentials
            from kuangchao.platform.execution.group import RayWorkerGroup

            credentials = credentials or Credentials(job_id, authority, store)
        self.credentials = credentials
        if group is None:
            group = RayWorkerGroup(job_id, settings, self.credentials,
                                   lambda: self.store.cancel_requested(job_id), poll_s)
        self.group = group
        self.formation = Formation(store, job_id, group, watch_factory)
        self.detector = FailureDetector(store, job_id, group, self.formation,
                                        redis_address(settings.redis_url))
        self.in_place = InPlaceReplacement(store, job_id, group, self.formation)
        self.resizer = ResizeExecutor(store, job_id, group, self.formation, live=False)
        self.drain = DrainResponder(store, job_id, group, self.resizer)
        self.keepers = JobKeepers(store, job_id, group, self.credentials)  # checkpoint.in_memory
        self.latest_checkpoint = latest_checkpoint or _latest_verified
        self.backend = ""

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
            self._finish(spec, self._watch_and_recover(spec))
        except WorkerLost as exc:
            assert spec is not None
            self._handle_lost(exc.failure, spec)
        except Cancelled:
            self._teardown()
            self._apply(cancel, "cancelled on request")
        except Preempted as exc:
            self._teardown()
            req = self.resizer.by_restart
            self._requeue(exc.message if req is None else
                          f"resizing to {req['to']} replica(s) by a restart ({req.get('cause')}): "
                          "checkpointed; the scheduler places it again")
        except Exception as exc:
            if not isinstance(exc, KuangchaoError):
                # A bug of ours, not the job's: keep the traceback for the report.
                self.store.add_logs(self.job_id, [{
                    "ts": time.time(), "level": "ERROR", "job_id": self.job_id, "rank": None,
                    "module": "controller", "message": traceback.format_exc()}])
            self._teardown()
            self._apply(fail, exc.message if isinstance(exc, KuangchaoError)
                        else f"{type(exc).__name__}: {exc}")
        finally:
            self._teardown()
            self.keepers.end()  # once the job is terminal
            self.credentials.retire(self.store)
        return self.store.get(self.job_id).state.value

    def _took_over(self, job: JobRecord) -> bool:
        """Claim the job; True when an earlier run of this same controller died mid-job.

        Ray restarts a dead controller actor under the same name and runs
        `run` again. Its workers and placement group died with it (they are
        owned by it), so the job can only be recovered, not re-attached.
        """
        ident = claim(self.name, os.getpid())
        previous = self.store.claim_controller(self.job_id, ident)
        if previous is None or previous == ident or previous.endswith("/" + LAUNCHING):
            return False
        return controller_name(previous) == self.name and job.state in (
            JobState.RUNNING, JobState.RECOVERING, JobState.RESIZING, JobState.PLACING)

    def _handle_lost(self, failure: Failure, spec: JobSpec) -> None:
        """Tear down, record the failure (unless already) and send the job back to be placed."""
        t0 = time.monotonic()
        self._teardown()
        teardown_s = time.monotonic() - t0
        job = self.store.get(self.job_id)
        if job.state.is_terminal:
            return
        if job.state is JobState.RECOVERING or record_failure(
                self.store, self.job_id, failure, spec.fault_tolerance.max_restarts,
                self.settings.quarantine):
            requeue_for_recovery(self.store, self.job_id, teardown_s)

    # -- phases ------------------------------------------------------------
    def _start(self, job: JobRecord, spec: JobSpec) -> None:
        self.resizer.live = bool(spec.elastic_range.elastic and spec.live_resize)
        self.formation.begin(spec)
        infos = self.group.start(job.placement, spec)
        self.keepers.begin(spec, job.placement)  # before the ranks run
        self.formation.record(infos)
        self.backend = self.formation.form(infos)
        self._apply(start, f"{self.group.world} rank(s) joined the {self.backend} process group")
        self._note_placed()
        self._start_spares(spec)

    def _note_placed(self) -> None:
        """After a recovery, record how long re-placement took (requeue to RUNNING)."""
        job = self.store.get(self.job_id)
        last = job.restart_log[-1] if job.restart_log else None
        if last and "requeued_at" in last and "placement_s" not in last:
            self.store.annotate_restart(
                self.job_id, {"placement_s": round(time.time() - last["requeued_at"], 3)})

    def _start_spares(self, spec: JobSpec) -> None:
        """With `spare_workers`, keep a warm process on every node the job uses (and standbys)."""
        if spec.fault_tolerance.spare_workers:
            self.group.start_spares({p.node_id for p in self.store.get(self.job_id).placement})

    def _watch_and_recover(self, spec: JobSpec) -> list[Any]:
        """Watch the ranks; after a failure, recover as the failure policy decides."""
        doc = spec.model_dump(mode="json")
        self.group.run(doc)
        while True:
            try:
                return self._follow(spec)
            except WorkerLost as exc:
                decision = judge(self.store, self.job_id, exc.failure, self.group, spec,
                                 self.resizer.live, self.settings.quarantine)
                if decision.action is Action.REPLACE and self.in_place.replace(
                        exc.failure, self.detector.slot(exc.failure.rank), spec):
                    self.group.run(doc)
                elif not (decision.action is Action.RESHAPE  # survivors keep their work
                          and self.resizer.after_loss(exc.failure, decision, spec)):
                    raise
                self._start_spares(spec)  # replace the spare just used

    def _follow(self, spec: JobSpec) -> list[Any]:
        """Wait for every rank's `run` (a live resize may change who they are)."""
        results: dict[int, Any] = {}
        preempt_deadline: float | None = None
        while len(results) < self.group.world:
            # One ended rank is enough to act on: a dead rank is seen at once.
            for outcome in self.group.poll(self.poll_s, skip=set(results)):
                if outcome.died is not None:
                    raise WorkerLost(self.detector.died(outcome.rank, outcome.died))
                if outcome.error is not None:
                    # Survivors of a dead peer fail in their collectives first;
                    # blame the dead rank, which is what recovery must replace.
                    dead = self.group.dead_ranks()
                    if dead:
                        raise WorkerLost(self.detector.died(*dead[0]))
                    raise RankFailed(outcome.error)
                results[outcome.rank] = outcome.value
            if len(results) == self.group.world:
                break
            failure = self.detector.from_heartbeats(skip=set(results))
            if failure is not None:
                raise WorkerLost(failure)
            try:
                apply_reports(self.store, self.job_id, spec.fault_tolerance.max_restarts)
                if self.store.cancel_requested(self.job_id):
                    raise Cancelled("cancelled")
                if preempt_deadline is None and self.store.preempt_requested(self.job_id):
                    preempt_deadline = time.monotonic() + PREEMPT_GRACE_S
                if not results and self.store.resize_requested(self.job_id):
                    self.resizer.on_request(spec)
                self.drain.check(spec, finishing=bool(results))  # off a draining node
                self.group.spares.tick(spec)  # standby spares on nodes that came back or freed up
                self.keepers.tick(self.group.spares.standby_nodes())  # and keepers there ahead
            except redis.RedisError:
                pass  # Redis away: the heartbeat watch holds its verdicts; training goes on
            if preempt_deadline is not None and time.monotonic() > preempt_deadline:
                raise Preempted(f"preempted; workers did not checkpoint within {PREEMPT_GRACE_S:.0f}s "
                                "and were stopped")
        with contextlib.suppress(redis.RedisError):  # bookkeeping: the outcome does not wait on it
            apply_reports(self.store, self.job_id, spec.fault_tolerance.max_restarts)  # the last steps'
        out = [results[i] for i in range(self.group.world)]
        if out and isinstance(out[0], dict) and out[0].get("preempted"):
            raise Preempted(self.drain.yielded(out[0]) or
                            f"preempted at step {out[0].get('steps')}; checkpointed and requeued")
        return out

    def _finish(self, spec: JobSpec, results: list[Any]) -> None:
        first = (results[0] or {}) if results else {}
        ckpt = first.get("checkpoint")
        path = ckpt["path"] if ckpt else self.latest_checkpoint(spec, self.job_id)
        if path is None:
            raise KuangchaoError("the train function returned without saving a checkpoint; "
                                 "call ctx.checkpoint.save(...) before returning")
        try:
            where = self.credentials.within_job(path)
            manifest = verify_step_url(str(where)) if is_url(str(where)) else verify(Path(where))
        except CheckpointError as exc:
            raise KuangchaoError(f"final checkpoint does not verify: {exc.message}") from None
        final_loss = first.get("final_loss")
        self._apply(finish,
                    f"finished at step {manifest['step']}; final checkpoint {path}"
                    + (f"; final loss {final_loss:.4f}" if isinstance(final_loss, float) else ""))

    def _requeue(self, reason: str) -> None:
        """Give the GPUs back and return the job to the queue; it resumes from its checkpoint."""
        self.store.update(self.job_id, lambda j: requeue(j, reason, preemptions=j.preemptions + 1,
                                                         resize=None))
        self.store.clear_preempt(self.job_id)
        self.store.wake_scheduler(self.job_id)

    def _apply(self, operation: Callable[..., Change], reason: str) -> None:
        """Apply one of the state machine's operations to the job (a no-op where it does not apply)."""
        self.store.update(self.job_id, lambda j: operation(j, reason))

    def _teardown(self) -> None:
        self.group.teardown()
        self.formation.stop_watching()


def _latest_verified(spec: JobSpec, job_id: str) -> Path | str | None:
    """The newest verified checkpoint in the job's folder (a step URL in an object store:
    its objects all there at their sizes)."""
    if is_url(spec.checkpoint.path):
        store = job_checkpoints(spec.checkpoint.path, job_id)
        found = store.latest()
        return str(store.step_url(found[0])) if found else None
    latest = latest_verified(job_dir(spec.checkpoint.path, job_id))
    return latest[0] if latest else None
