"""The scheduler: each cycle snapshots the cluster, asks the admission policy,
and applies its decisions to the store. The policy decides purely over the
snapshot (plugins/); this is the thin shell that reads the store and writes
the decisions back. Pure of Ray and Redis: the store, the node source and the
launcher of job controllers are injected, so tests step it on a MemoryStore.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kuangchao.platform.cluster import quarantine
from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.errors import InvalidTransition, JobNotFound
from kuangchao.platform.jobs.state import JobRecord, JobState, PlacedRank, admit, cancel
from kuangchao.platform.observability import metrics
from kuangchao.platform.scheduling.plugins.decisions import (
    Admit,
    Decision,
    Preempt,
    Relocate,
    Resize,
    Wait,
)
from kuangchao.platform.scheduling.plugins.interface import AdmissionPolicy
from kuangchao.platform.scheduling.plugins.registry import make_policy
from kuangchao.platform.scheduling.plugins.relocation import open_request
from kuangchao.platform.scheduling.plugins.snapshot import Snapshot
from kuangchao.platform.scheduling.snapshot_keeper import SnapshotKeeper
from kuangchao.platform.spec.queues import QueueTable
from kuangchao.platform.spec.stored import spec_of

if TYPE_CHECKING:
    from kuangchao.platform.jobs.store import JobStore

log = logging.getLogger(__name__)


def _readmitted(job: JobRecord, replicas: int, world: int) -> tuple[dict, ...]:
    """A job placed again at another size (a resize by restart, or after a lost node)
    has resized: open (or correct) the entry its first step at that size closes."""
    log = job.resize_log
    if not job.replicas or job.replicas == replicas or job.started_at is None:
        return log
    last = log[-1] if log else None
    if last is not None and "first_step_at" not in last:  # the resize that sent it back
        return (*log[:-1], {**last, "to": replicas, "to_world_size": world})
    return (*log, {"from": job.replicas, "to": replicas, "from_world_size": job.world_size,
                   "to_world_size": world, "cause": "re-placed", "path": "restart",
                   "requested_at": time.time()})


def _placed(slots, first: int = 0) -> tuple[PlacedRank, ...]:
    """A plan's slots as placement entries, numbered from `first` (past the world for the
    slots a grow or a relocation adds while the job runs)."""
    return tuple(PlacedRank(rank=first + s.rank, node=s.node, node_id=s.node_id, leaf=s.leaf,
                            gpu=s.gpus[0] if s.gpus else None, gpus=s.gpus) for s in slots)


class Scheduler:
    """One scheduling cycle at a time; see `step`.

    Args:
        store: Where jobs live.
        nodes: Returns the current node view (the Registry's snapshot).
        launch: Starts a controller for an admitted job run by the scheduler.
        policy: The admission policy; by default the one the queue table names
            (`policy:` in the queues file, `gang` unless set), chosen each cycle.
    """

    def __init__(self, store: JobStore, nodes: Callable[[], tuple[NodeInfo, ...]],
                 launch: Callable[[str], None], policy: AdmissionPolicy | None = None) -> None:
        self.store, self.nodes, self.launch, self.policy = store, nodes, launch, policy
        self.metrics = store.recorder()
        # Kept across cycles: each cycle applies only the jobs that changed since
        # the last one, with a periodic full rebuild (snapshot_keeper.py).
        self.keeper = SnapshotKeeper()

    def snapshot(self) -> Snapshot:
        jobs = self.store.list_active()
        # A quarantined or draining node is as good as gone for new placements;
        # jobs already running there keep running (a drained job's controller
        # moves it off: platform/execution/drain.py).
        blocked = quarantine.active(self.store.quarantine(), time.time())
        nodes = tuple(dataclasses.replace(n, alive=False)
                      if n.draining or quarantine.holds(blocked, n) else n for n in self.nodes())
        return self.keeper.refresh(nodes, jobs, QueueTable.from_json(self.store.info("queues")))

    def step(self) -> list[Decision]:
        """Run one cycle: cancel queued jobs on request, then admit in policy order."""
        started = time.perf_counter()
        decisions = self._step()
        if decisions:  # idle cycles (nothing queued) would only dilute the histogram
            self.metrics.observe(metrics.SCHEDULER_CYCLE, time.perf_counter() - started)
        return decisions

    def _step(self) -> list[Decision]:
        snap = self.snapshot()
        queued = []
        for job in snap.queued:
            if self.store.cancel_requested(job.id):
                self._cancel_queued(job.id)
            else:
                queued.append(job)
        snap = dataclasses.replace(snap, queued=tuple(queued))
        policy = self.policy or make_policy(snap.queues.policy)
        decisions = policy.decide(snap)
        for d in decisions:
            if isinstance(d, Admit):
                self._admit(d)
            elif isinstance(d, Preempt):
                self._preempt(d)
            elif isinstance(d, Resize):
                self._resize(d)
            elif isinstance(d, Relocate):
                self._relocate(d)
            else:
                self._wait(d)
        return decisions

    def _preempt(self, d: Preempt) -> None:
        def mark(j: JobRecord):
            if not j.state.holds_resources or j.preempting_for:
                return None
            return dataclasses.replace(j, preempting_for=d.for_job), {
                "type": "preempt", "message": d.reason}
        if self.store.update(d.job_id, mark) is not None:
            self.store.request_preempt(d.job_id, d.for_job)

    def _cancel_queued(self, job_id: str) -> None:
        try:
            self.store.update(job_id, lambda j: cancel(j, "cancelled while queued", only_queued=True))
        except (InvalidTransition, JobNotFound) as exc:
            log.info("cancel of %s skipped: %s", job_id, exc)

    def _admit(self, d: Admit) -> None:
        placement = _placed(d.plan.slots)

        queued_at = [0.0]  # since it last entered the queue (a requeue starts a new wait)

        def grant(j: JobRecord):
            if j.state is not JobState.QUEUED:
                return None
            queued_at[0] = j.state_since or j.created_at
            rng = spec_of(j.spec).elastic_range
            replicas = d.replicas or len(placement) // rng.ranks_per_replica
            summary = ", ".join(f"{p.rank}:{p.node}/{p.gpu}" for p in placement)
            size = (f"{replicas} of {rng.min_replicas}..{rng.max_replicas} replicas; "
                    if rng.elastic else "")
            return admit(j, f"admitted; {size}placement {summary}",
                         placement=placement, replicas=replicas, world_size=len(placement),
                         gpus=len(placement) * rng.gpus_per_rank,
                         resize_log=_readmitted(j, replicas, len(placement)))
        if self.store.update(d.job_id, grant) is None:
            return
        job = self.store.get(d.job_id)
        self.metrics.observe(metrics.QUEUE_WAIT, max(0.0, (job.state_since or time.time())
                                                     - queued_at[0]), queue=job.queue)
        self.metrics.observe(metrics.PLACEMENT_SOLVE, d.solve_s)
        if job.driver == "scheduler":
            self.launch(d.job_id)

    def _resize(self, d: Resize) -> None:
        """Ask a running job's controller to resize; a grow holds its new GPUs from now on."""
        def ask(j: JobRecord):
            if j.state is not JobState.RUNNING or j.resize is not None:
                return None
            added = _placed(d.plan.slots if d.plan else (), first=j.world_size)
            request = {"to": d.to, "from": j.replicas, "cause": d.cause, "for_job": d.for_job,
                       "requested_at": time.time()}
            return dataclasses.replace(j, resize=request, placement=j.placement + added), {
                "type": "resize_requested", "message": d.reason, "cause": d.cause,
                "from_replicas": j.replicas, "to_replicas": d.to}
        if self.store.update(d.job_id, ask) is not None:
            self.store.request_resize(d.job_id)

    def _relocate(self, d: Relocate) -> None:
        """Answer a running job's relocation request (platform/execution/relocation.py):
        the new slots join its placement from now on (ranks past its world, as a grow's),
        so that no other job is placed on them; or why not."""
        def answer(j: JobRecord):
            req = open_request(j)
            if req is None or float(req.get("requested_at") or 0.0) != d.requested_at:
                return None  # answered already, withdrawn, or a newer request
            if d.plan is None:  # said once: a lost replica's request is asked again meanwhile
                return dataclasses.replace(j, relocate={**req, "refused": d.reason,
                                                        "answered_at": time.time()}), (
                    None if req.get("asked_again") else
                    {"type": "relocation_refused", "message": d.reason})
            added = _placed(d.plan.slots, first=j.world_size)
            placed = {**req, "placed": [p.to_json() for p in added], "answered_at": time.time()}
            return dataclasses.replace(j, relocate=placed, placement=j.placement + added), {
                "type": "relocation_placed", "message": d.reason}
        self.store.update(d.job_id, answer)

    def _wait(self, d: Wait) -> None:
        def note(j: JobRecord):
            if j.state is not JobState.QUEUED or j.waiting_for == d.reason:
                return None
            return dataclasses.replace(j, waiting_for=d.reason), {
                "type": "waiting", "message": d.reason}
        self.store.update(d.job_id, note)
