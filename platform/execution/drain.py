"""The job controller's side of a drain notice: move the job's ranks off a draining node.

The controller's watch loop calls `DrainResponder.check` with each poll; at most every
`DRAIN_POLL_S` it reads Ray's drain table (from the GCS, which only an operator or the
autoscaler writes: nothing a rank can set), asks the drain policy (drain_policy.py) and
applies the decision:

- the first time a drain concerns the job: a `node_draining` event (the nodes, the ranks
  there, the deadline, the step reached) and an audit record;
- SHRINK: a planned live resize without the replicas on the draining nodes
  (`ResizeExecutor.shrink_off`); they leave at their next step and the others go on, so
  nothing is redone. Then `drained_off`.
- MOVE: the scheduler places the replicas there elsewhere (platform/execution/relocation.py),
  their new ranks start while every rank trains on, and a planned generation change
  (`ResizeExecutor.move_off`) lets the ranks there leave at their next step while the
  new ones take the survivors' state. Then `drained_off` (`how: move`). No room, or a
  move called off: the next poll requeues instead.
- REQUEUE: the job's preempt flag, with a reason of `drain: <nodes>`. Every rank agrees on
  it at the next step boundary, the checkpoint of that step is written, and the ranks
  return (the preemption path of workers/trainer/loop.py). `yielded` records
  `drain_checkpoint` and `drained_off` and names the requeue's reason; the scheduler places
  the job again off the draining nodes, and it resumes at the step it stopped.

Should the node go first (its deadline passed before the checkpoint), its ranks die with
it and the normal failure path takes the job over. The responder then stands down: its
preempt request is withdrawn (here, once the job has no rank left there, or by the next
run's responder), so the recovered job does not yield a second time for the same drain.
A drain that ends (the node undrained) before the job acted leaves it where it is; one
that ends after the job asked to move lets the move finish.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from kuangchao.platform.cluster.drain import DrainNotice, describe_deadline, notices_from
from kuangchao.platform.cluster.registry import draining_nodes
from kuangchao.platform.execution.drain_policy import DrainAction, DrainDecision, DrainView, decide
from kuangchao.platform.jobs.state import JobRecord, JobState, PlacedRank
from kuangchao.platform.security.audit import AuditLog, AuditRecord, default_trail
from kuangchao.platform.spec.jobspec import JobSpec

log = logging.getLogger(__name__)

# Ray Train polls the same table once a second; a deadline is tens of seconds at least.
DRAIN_POLL_S = 1.0
# The preempt flag's value when a drain raised it: it tells the drain's request from a
# scheduler's preemption, which must never be withdrawn here.
DRAIN_TAG = "drain: "
AUDIT_PRINCIPAL = "ray-gcs"  # who drains: an operator or autoscaler, through Ray's GCS


def ray_notices() -> Mapping[str, DrainNotice]:
    """The drain notices Ray's GCS holds now, by node id."""
    return notices_from(draining_nodes())


class DrainResponder:
    """Moves one job off the nodes Ray drains; see the module's docstring.

    Args:
        store: The job store.
        job_id: The job.
        group: The worker group (its `world`: the ranks running now).
        resizer: The job's `ResizeExecutor` (`live`, `shrink_off`).
        source: Returns the drain notices by node id (default: Ray's GCS).
        trail: Where the decisions are audited (default: the audit trail).
        poll_s: The least time between two reads of the drain table.
    """

    def __init__(self, store: Any, job_id: str, group: Any, resizer: Any,
                 source: Callable[[], Mapping[str, DrainNotice]] = ray_notices,
                 trail: AuditLog | None = None, poll_s: float = DRAIN_POLL_S) -> None:
        self.store, self.job_id, self.group, self.resizer = store, job_id, group, resizer
        self.source, self.trail, self.poll_s = source, trail, poll_s
        self.pending: DrainDecision | None = None  # a requeue asked; the ranks not yet gone
        self.noticed: set[str] = set()  # nodes whose drain this run announced
        self._no_shrink = False  # a drain shrink or move was called off: requeue instead
        self._next = 0.0
        self._first = True

    def check(self, spec: JobSpec, finishing: bool = False) -> None:
        """Act on the drain notices that concern the job (at most every `poll_s`).

        `finishing`: some ranks returned already (the job is ending): nothing to move.
        """
        now = time.monotonic()
        if finishing or now < self._next:
            return
        self._next = now + self.poll_s
        if self._first:  # an earlier run's request: that run left through the failure path
            self._first = False
            self._stand_down(self._withdraw())
        if self.pending is not None:
            self._follow_up()
            return
        try:
            notices = self.source()
        except Exception as exc:  # noqa: BLE001 -- the GCS away: training goes on, try next poll
            log.warning("job %s: could not read Ray's draining nodes: %s", self.job_id, exc)
            return
        if not notices:
            return
        job = self.store.get(self.job_id)
        if job.state is not JobState.RUNNING or job.resize is not None:
            return  # mid-resize or recovering: decided again at the next poll
        d = decide(DrainView(self._slots(job), notices, self.resizer.live and not self._no_shrink,
                             spec.elastic_range, keeps=spec.survivors_keep_work and not self._no_shrink))
        if d.action is DrainAction.NONE:
            return
        self._announce(d)
        if d.action is DrainAction.SHRINK:
            self._shrink(spec, d)
        elif d.action is DrainAction.MOVE:
            self._move(spec, d)
        else:
            self.pending = d
            self.store.request_preempt(self.job_id, DRAIN_TAG + ", ".join(d.nodes))

    def yielded(self, result: Any) -> str | None:
        """The ranks returned after a preemption: when the drain asked for it, record the
        checkpoint they took and return the requeue's reason (None: not the drain's)."""
        if self.pending is None or not isinstance(result, dict):
            return None
        d, self.pending = self.pending, None
        step = result.get("steps")
        ckpt = result.get("checkpoint")
        path = ckpt.get("path") if isinstance(ckpt, dict) else None
        where = ", ".join(d.nodes)
        self._event("drain_checkpoint", d, step=step, path=path,
                    message=f"checkpointed step {step} before leaving {where}"
                            + (f": {path}" if path else ""))
        self._event("drained_off", d, step=step, how="requeue",
                    message=f"rank(s) {_ranks(d.ranks)} left {where} at step {step}; the job "
                            "is placed again off the draining node(s) and resumes there")
        return (f"drained off {where} at step {step}: checkpointed, and placed again "
                "elsewhere (a planned move, not a failure)")

    # -- the two moves ----------------------------------------------------------------
    def _shrink(self, spec: JobSpec, d: DrainDecision) -> None:
        assert d.membership is not None
        if self.resizer.shrink_off(spec, d.membership, "drain"):
            replicas = d.membership.world_size // spec.elastic_range.ranks_per_replica
            step = self._step()
            self._event("drained_off", d, step=step, how="shrink",
                        message=f"rank(s) {_ranks(d.ranks)} left {', '.join(d.nodes)} by step "
                                f"{step}; {replicas} replica(s) train on, no step redone")
        elif self.store.get(self.job_id).state is JobState.RUNNING:
            self._no_shrink = True  # called off: the next poll asks for a checkpoint instead

    def _move(self, spec: JobSpec, d: DrainDecision) -> None:
        assert d.membership is not None
        if self.resizer.move_off(spec, d.membership, d.replicas, list(d.nodes), "drain"):
            placed = {p.node for p in self._slots(self.store.get(self.job_id))
                      if p.rank in set(d.membership.joining)}
            self._event("drained_off", d, step=self._step(), how="move",
                        message=f"rank(s) {_ranks(d.ranks)} left {', '.join(d.nodes)} by step "
                                f"{self._step()}; their replica(s) train on "
                                f"{', '.join(sorted(placed))}, no step redone")
        elif self.store.get(self.job_id).state is JobState.RUNNING:
            self._no_shrink = True  # no room, or called off: the next poll checkpoints instead

    def _follow_up(self) -> None:
        """A requeue is pending: stand down once the job has no rank left on those nodes
        (the node went first, and the failure path moved the job)."""
        assert self.pending is not None
        slots = self._slots(self.store.get(self.job_id))
        if any(s.node in self.pending.nodes for s in slots):
            return
        self.pending = None
        self._stand_down(self._withdraw())

    def _withdraw(self) -> list[str] | None:
        """Take the drain's checkpoint request back; the nodes it named, None when the
        job's preempt flag is down or not the drain's (a scheduler's preemption stays)."""
        reason = self.store.preempt_reason(self.job_id)
        if not (isinstance(reason, str) and reason.startswith(DRAIN_TAG)):
            return None
        self.store.clear_preempt(self.job_id)
        return reason[len(DRAIN_TAG):].split(", ")

    def _stand_down(self, nodes: list[str] | None) -> None:
        if nodes is None:
            return
        where = ", ".join(nodes)
        self.store.add_event(self.job_id, {
            "type": "drained_off", "nodes": nodes, "how": "failure",
            "message": f"{where} went before the job yielded to the drain; the failure path "
                       "moved the job, and the drain's checkpoint request is withdrawn"})

    # -- records ----------------------------------------------------------------------
    def _slots(self, job: JobRecord) -> tuple[PlacedRank, ...]:
        """The running group's ranks (not the slots a pending grow reserved)."""
        return tuple(p for p in job.placement if p.rank < self.group.world)

    def _step(self) -> int:
        try:
            return int(self.store.progress(self.job_id).get("step") or 0)
        except (TypeError, ValueError):
            return 0

    def _announce(self, d: DrainDecision) -> None:
        new = [n for n in d.nodes if n not in self.noticed]
        if not new:
            return
        self.noticed.update(new)
        when = describe_deadline(d.deadline, time.time())
        message = (f"{', '.join(d.nodes)} draining ({when}), rank(s) {_ranks(d.ranks)} there: "
                   f"{d.reason}")
        self._event("node_draining", d, step=self._step(), deadline=d.deadline,
                    ranks=sorted(d.ranks), action=d.action.value, message=message)
        self._audit(d, message)

    def _event(self, kind: str, d: DrainDecision, **fields: Any) -> None:
        self.store.add_event(self.job_id, {"type": kind, "nodes": list(d.nodes), **fields})

    def _audit(self, d: DrainDecision, message: str) -> None:
        if self.trail is None:
            self.trail = default_trail(self.store)
        self.trail.record(AuditRecord(
            principal=AUDIT_PRINCIPAL, action=f"job.drain_{d.action.value}",
            resource=f"node/{','.join(d.nodes)}", decision="allow", reason=message,
            job=self.job_id))


def _ranks(ranks: frozenset[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))
