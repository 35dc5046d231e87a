"""The controller's side of the ranks' reports: it, not the ranks, writes the job.

A rank's code is the job's to choose (a custom entrypoint runs anything), so the
job record and its state machine are the control plane's alone. What a rank has
to say about the job goes through `JobStore.post_report`, and the controller
applies it between two polls of its ranks:

- `numeric_fault`: rank 0 saw a NaN loss or a gradient spike. Counted as a
  restart (RECOVERING), or the job FAILS past `fault_tolerance.max_restarts`;
  the answer (`{"roll_back": bool}`) is what rank 0 waits for before its ranks
  roll back.
- `rolled_back`: the ranks restored the last good state; the restart entry gets
  its timings and the job is RUNNING again.
- `first_step`: the first step after a restart or at a new size; it closes the
  open resize entry (with its event and metrics) and stamps the restart entry.
  After a live recovery (the survivors kept their work, restart entry `path`
  "live") it is the survivors' first step in the new generation: the entry gets
  `survivor_stall_s`, from the failure's declaration to that step, and the job an
  event saying at which step the survivors went on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kuangchao.platform.execution.recovery import Failure, record_failure
from kuangchao.platform.jobs.state import resume_after_rollback
from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.observability import metrics

log = logging.getLogger(__name__)


def apply_reports(store: JobStore, job_id: str, max_restarts: int) -> int:
    """Apply every report the ranks posted since the last call; returns how many."""
    reports = store.take_reports(job_id)
    for report in reports:
        handler = _HANDLERS.get(str(report.get("kind")))
        if handler is None:
            log.warning("job %s: ignored a rank report of unknown kind %r", job_id, report.get("kind"))
            continue
        try:
            handler(store, job_id, report, max_restarts)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("job %s: ignored a malformed %s report: %s", job_id, report["kind"], exc)
    return len(reports)


def _numeric_fault(store: JobStore, job_id: str, report: dict[str, Any], max_restarts: int) -> None:
    ok = record_failure(store, job_id, Failure("numeric", str(report["message"])), max_restarts)
    store.answer_report(job_id, str(report["id"]), {"roll_back": ok})


def _rolled_back(store: JobStore, job_id: str, report: dict[str, Any], _max: int) -> None:
    store.annotate_restart(job_id, dict(report["restart"]))
    store.update(job_id, lambda j: resume_after_rollback(j, str(report["reason"])))


def _first_step(store: JobStore, job_id: str, report: dict[str, Any], _max: int) -> None:
    entry = store.close_resize(job_id, float(report["at"]), int(report["world_size"]))
    if entry:
        _resized(store, job_id, entry)
    if report.get("restart"):
        store.annotate_restart(job_id, dict(report["restart"]))
    elif report.get("after") == "resize":
        _kept_work(store, job_id, report)


def _kept_work(store: JobStore, job_id: str, report: dict[str, Any]) -> None:
    """The survivors' first step after the live recovery that formed this generation."""
    job = store.get(job_id)
    last = job.restart_log[-1] if job.restart_log else None
    if (last is None or last.get("path") != "live" or "survivor_stall_s" in last
            or last.get("generation") != report.get("generation")):
        return  # a planned resize's first step, or this recovery's is recorded already
    at, step = float(report["at"]), int(report["step"])
    stall = round(at - float(last.get("failed_at", at)), 3)
    took = report.get("first_step_s")
    store.annotate_restart(job_id, {
        "survivor_stall_s": stall, "first_step_at": at, "resumed_step": step - 1,
        "first_step_s": round(float(took), 3) if isinstance(took, int | float) else None})
    store.add_event(job_id, {
        "type": "survivors_kept", "step": step - 1, "survivor_stall_s": stall,
        "restart": last.get("restart"),
        "message": f"the survivors kept their work at step {step - 1}: no step redone; they "
                   f"trained step {step} {stall:.2f}s after the failure was declared"})


def _resized(store: JobStore, job_id: str, entry: dict[str, Any]) -> None:
    took = entry["resize_s"]
    rec = store.recorder(job_id)
    rec.inc(metrics.RESIZES, job=job_id)
    rec.observe(metrics.RESIZE_SECONDS, took, job=job_id)
    store.add_event(job_id, {
        "type": "resize", "from_world_size": entry.get("from_world_size"),
        "to_world_size": entry.get("to_world_size"), "from_replicas": entry.get("from"),
        "to_replicas": entry.get("to"), "cause": entry.get("cause"), "resize_s": took,
        "path": entry.get("path"), "moved": entry.get("moved"),
        "message": (f"moved {entry['moved']} rank(s) to other nodes ({entry.get('cause')}); "
                    f"first step after the move {took:.2f}s after the decision")
        if entry.get("moved") else
        f"resized from {entry.get('from_world_size')} to {entry.get('to_world_size')} "
        f"rank(s) ({entry.get('cause')}); first step at the new size {took:.2f}s after the "
        "decision"})


_HANDLERS: dict[str, Callable[[JobStore, str, dict[str, Any], int], None]] = {
    "numeric_fault": _numeric_fault,
    "rolled_back": _rolled_back,
    "first_step": _first_step,
}
