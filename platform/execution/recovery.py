"""What happens to a job after one of its ranks failed.

`Failure` is what the controller learned (cause, rank, node, how fast);
`record_failure` writes it as a restart (or the final FAILED), reports the
node for quarantine, and returns whether the job may go on. Separate from the
controller so that the bookkeeping is the same for every detection path and
every recovery path.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from kuangchao.platform.cluster import quarantine
from kuangchao.platform.cluster.quarantine import NODE_FAULT_KINDS, QuarantinePolicy
from kuangchao.platform.errors import GaveUp
from kuangchao.platform.execution.failure_policy import (
    Action,
    FailureDecision,
    FailureView,
    decide,
    restarts_exhausted,
)
from kuangchao.platform.jobs.state import Change, JobRecord, JobState, fail, recover, requeue
from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.observability import metrics


@dataclass
class Failure:
    """One failure of a running job.

    kind: `died` (process or actor gone), `node_lost`, `expired` (heartbeat
        gone, process still there), `hung` (no progress), `numeric` (NaN or
        gradient spike), `controller` (the job's controller was restarted).
    unreachable: For a node lost to the network: `network` (cut off from the
        controller's side) or `redis` (answers Ray, cannot reach Redis); `agent`
        for one whose node agent stopped writing its record (relayed.py).
    detected_after_s: From the last good heartbeat (or last progress, for a
        hang) to the moment the controller marked the rank failed.
    """

    kind: str
    message: str
    rank: int | None = None
    node: str | None = None
    pid: int | None = None
    detected_after_s: float | None = None
    last_heartbeat_at: float | None = None
    failed_at: float = field(default_factory=time.time)
    node_id: str | None = None
    unreachable: str | None = None

    def record(self) -> dict[str, Any]:
        d = {"cause": self.message, **dataclasses.asdict(self)}
        d.pop("message")
        return {k: v for k, v in d.items() if v is not None}


def record_failure(store: JobStore, job_id: str, failure: Failure, max_restarts: int,
                   policy: QuarantinePolicy | None = None) -> bool:
    """Record a failure: a restart entry and event, or FAILED past `max_restarts`.

    Returns:
        True when the job is now RECOVERING and should be brought back.
    """
    quarantined = report_node(store, failure, policy or QuarantinePolicy())
    job = store.get(job_id)
    if job.state.is_terminal:
        return False
    gave_up = (f"gave up after {job.restarts} restart(s) (fault_tolerance.max_restarts)"
               if restarts_exhausted(job.restarts, max_restarts) else None)
    return write_failure(store, job_id, failure, quarantined, gave_up)


def write_failure(store: JobStore, job_id: str, failure: Failure,
                  quarantined: dict[str, Any] | None, gave_up: str | None) -> bool:
    """The failure's events and metrics, then FAILED (`gave_up` says why) or RECOVERING.

    Returns:
        True when the job is now RECOVERING.
    """
    store.add_event(job_id, {"type": "failure", "message": failure.message, **failure.record(),
                             **reached(store, job_id)})
    if failure.detected_after_s is not None:
        store.recorder().observe(
            metrics.FAILURE_DETECTION, failure.detected_after_s, cause=failure.kind)
    if quarantined:
        until = time.strftime("%H:%M:%S", time.localtime(quarantined["until"]))
        store.add_event(job_id, {"type": "quarantine", "node": failure.node,
                                 "message": f"node {failure.node} quarantined until {until}: "
                                            f"{quarantined['reason']}"})
    if gave_up is not None:
        store.update(job_id, lambda j: fail(j, f"{failure.message}; {gave_up}"))
        return False

    def restart(j: JobRecord) -> Change:
        return recover(j, failure.message, {"restart": j.restarts + 1, **failure.record()})

    if store.update(job_id, restart) is None:
        return False
    store.recorder(job_id).inc(metrics.RESTARTS, job=job_id,
                                                          cause=failure.kind)
    return True


def reached(store: JobStore, job_id: str) -> dict[str, Any]:
    """The step rank 0 had last reported when the failure was declared, and when.

    For the goodput ledger (platform/jobs/goodput_facts.py): the loss curve holds
    only logged steps, and a failed rank's last heartbeat may be older than steps
    its peers finished with it, so without this the steps trained since the last
    logged one would count as detection rather than as work a rollback undoes.
    """
    try:
        progress = store.progress(job_id)
    except Exception:  # noqa: BLE001 -- bookkeeping: the failure is written without it
        return {}
    step, at = progress.get("step"), progress.get("updated_at")
    if isinstance(step, int) and isinstance(at, int | float):
        return {"progress_step": step, "progress_at": at}
    return {}


def judge(store: JobStore, job_id: str, failure: Failure, group: Any, spec: Any, live: bool,
          policy: QuarantinePolicy | None = None) -> FailureDecision:
    """Count a running job's failure and ask the failure policy what to do about it.

    The node is reported first, since the failure may put it in quarantine,
    which the policy must see. `group` answers which nodes are lost and
    whether a placement group still holds the ranks.

    Raises:
        GaveUp: The job has ended (past `max_restarts`, or another path ended it).
    """
    quarantined = report_node(store, failure, policy or QuarantinePolicy())
    job = store.get(job_id)
    if job.state.is_terminal:
        raise GaveUp(failure.message)
    slots = tuple(p for p in job.placement if p.rank < group.world)
    keeps = bool(spec.survivors_keep_work)  # a failed replica is refilled live, elastic or not
    nodes = {s.node_id for s in slots} if live or keeps else set()
    lost = group.lost_among(nodes) if nodes else frozenset()
    decision = decide(FailureView(
        kind=failure.kind, rank=failure.rank, restarts=job.restarts,
        max_restarts=spec.fault_tolerance.max_restarts, live=live, has_group=group.placed,
        slots=slots, lost_nodes=lost,
        blocked=frozenset(quarantine.active(store.quarantine(), time.time())),
        elastic=spec.elastic_range, keeps=keeps, unreachable=failure.unreachable))
    gave_up = decision.reason if decision.action is Action.FAIL else None
    if not write_failure(store, job_id, failure, quarantined, gave_up):
        raise GaveUp(failure.message)
    return decision


def requeue_for_recovery(store: JobStore, job_id: str, teardown_s: float) -> None:
    """Send a RECOVERING job back to the scheduler to be placed again."""
    store.annotate_restart(job_id, {"teardown_s": round(teardown_s, 3), "path": "requeue",
                                    "requeued_at": time.time()})
    store.update(job_id, lambda j: requeue(j, "re-placing; resumes from the newest verified checkpoint",
                                           only_from=JobState.RECOVERING))
    store.wake_scheduler(job_id)


def report_node(store: JobStore, failure: Failure,
                 policy: QuarantinePolicy) -> dict[str, Any] | None:
    """Count the failure against its node; quarantine the node past the policy's limit.

    Returns:
        The new quarantine entry, or None when the node was not (newly) quarantined.
    """
    if not (failure.node and failure.kind in NODE_FAULT_KINDS):
        return None
    if not policy.enabled and failure.kind != "node_lost":
        return None
    # A lost node is held back even with quarantine off: it is a fact, not a judgement.
    times = (store.record_node_failure(failure.node, failure.failed_at, policy.window_s)
             if policy.enabled else [])
    now = failure.failed_at
    if policy.should_quarantine(times, now):
        until = now + policy.duration_s
        reason = f"{len(times)} failures within {policy.window_s:.0f}s; last: {failure.message}"
    elif failure.kind == "node_lost":
        gone = ("its node agent stopped" if failure.unreachable == "agent" else
                "unreachable" if failure.unreachable else "its raylet is gone")
        until, reason = now + policy.lost_node_s, f"{gone}: {failure.message}"
    else:
        return None
    current = store.quarantine().get(failure.node)
    if current and float(current.get("until", 0)) >= until:
        return None
    entry = {"since": now, "until": until, "failures": len(times), "reason": reason}
    if failure.kind == "node_lost" and failure.node_id:
        # Only that raylet is held back: a node that rejoins under the same name is a new one.
        entry["node_id"] = failure.node_id
    store.quarantine_node(failure.node, entry)
    return entry
