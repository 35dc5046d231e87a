"""The goodput ledger's facts, read from what a job already records.

Every fact but one comes from a record another part of the system keeps for
its own reasons, and whose timestamps the ledger can trust.

- `state` events (platform/jobs/state.py, every transition): the modes, and
  which time is queueing, start-up, recovery or preemption;
- `failure` events (platform/execution/recovery.py): `failed_at` is the
  declaration; the failure's own moment is `failed_at - detected_after_s` (the
  last good heartbeat, or the last progress for a hang); `progress_step` and
  `progress_at`, rank 0's last report at the declaration, are a step completion
  (the one fact written for goodput: the curve logs every `log_interval` steps);
- the loss curve (rank 0's logged steps; the first step of every run is always
  logged, workers/trainer/loop.py) and the progress hash (its newest step):
  step completions, whose numbers show every rollback;
- the checkpoint list (rank 0's commits, workers/runtime/worker.py): the step
  each checkpoint saved and how long it blocked training (`blocked_s`);
- the resize log: a live resize's formation time (`formed_s`), while the
  survivors wait for the joiners;
- the restart log: a live recovery whose survivors kept their work (`path`
  "live", closed by their first step with `survivor_stall_s`), which rolls
  nothing back.

Every value is checked: a record of an older release, or one a rank's code
wrote oddly, costs its fact, never the view. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from kuangchao.platform.jobs.state import JobRecord
from kuangchao.platform.observability.goodput import (
    Fact,
    Failure,
    Goodput,
    Kept,
    Stall,
    State,
    Step,
    account,
)

TRIMMED = ("the job's oldest events were trimmed (the event list keeps the newest); the time "
           "before the oldest kept one counts as other")


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def _step(v: Any) -> int | None:
    n = _num(v)
    return int(n) if n is not None and n >= 0 and n == int(n) else None


def event_facts(events: Iterable[Any]) -> list[Fact]:
    """State changes and failures from the job's events."""
    out: list[Fact] = []
    for e in events:
        if not isinstance(e, dict) or (ts := _num(e.get("ts"))) is None:
            continue
        if e.get("type") == "state" and isinstance(e.get("to"), str):
            frm = e.get("from")
            out.append(State(ts, e["to"], frm if isinstance(frm, str) else None))
        elif e.get("type") == "failure":
            declared = _num(e.get("failed_at")) or ts
            took = _num(e.get("detected_after_s"))
            beat = _num(e.get("last_heartbeat_at"))
            at = declared - took if took is not None and took >= 0 else beat or declared
            out.append(Failure(min(at, declared), declared))
            step, step_at = _step(e.get("progress_step")), _num(e.get("progress_at"))
            if step is not None and step_at is not None:
                out.append(Step(min(step_at, declared), step))
    return out


def step_facts(points: Iterable[Any], progress: dict[str, Any] | None) -> list[Fact]:
    """Step completions: the curve's logged steps and the progress hash's newest step."""
    out: list[Fact] = []
    for p in [*points, progress or {}]:
        if not isinstance(p, dict):
            continue
        ts = _num(p.get("ts", p.get("updated_at")))
        step = _step(p.get("step"))
        if ts is not None and step is not None:
            out.append(Step(ts, step))
    return out


def checkpoint_facts(checkpoints: Iterable[Any]) -> list[Fact]:
    """Each committed checkpoint: its step, done when the save began, and its stall."""
    out: list[Fact] = []
    for c in checkpoints:
        if not isinstance(c, dict):
            continue
        committed, step = _num(c.get("committed_at")), _step(c.get("step"))
        blocked, write = _num(c.get("blocked_s")) or 0.0, _num(c.get("write_s")) or 0.0
        if committed is None or step is None or blocked < 0:
            continue
        # A background write commits after training went on: its stall (the staging)
        # ended when the write began. A synchronous one blocked until the commit.
        stall_end = committed - write if write > blocked else committed
        out.append(Step(stall_end - blocked, step, checkpoint=True))
        if blocked > 0:
            out.append(Stall(stall_end, blocked, "checkpoint"))
    return out


def resize_facts(resize_log: Iterable[Any]) -> list[Fact]:
    """A finished live resize: the survivors' wait for the new generation (`other`)."""
    out: list[Fact] = []
    for r in resize_log:
        if not isinstance(r, dict) or r.get("path") != "live":
            continue
        at, took, formed = (_num(r.get(k)) for k in ("requested_at", "resize_s", "formed_s"))
        if at is not None and took is not None and formed is not None and formed > 0:
            out.append(Stall(at + took, formed, "other"))
    return out


def restart_facts(restart_log: Iterable[Any]) -> list[Fact]:
    """Live recoveries whose survivors went on from their own step (no rollback)."""
    out: list[Fact] = []
    for r in restart_log:
        if not isinstance(r, dict) or r.get("path") != "live":
            continue
        at = _num(r.get("failed_at"))
        if at is not None and _num(r.get("survivor_stall_s")) is not None:
            out.append(Kept(at))
    return out


def job_goodput(job: JobRecord, events: list[Any], points: list[Any], checkpoints: list[Any],
                progress: dict[str, Any] | None, now: float) -> Goodput:
    """The split of `job`'s wall-clock time, from its records (live jobs: up to `now`)."""
    first = events[0] if events and isinstance(events[0], dict) else {}
    created = first.get("type") == "state" and first.get("from") is None
    facts = [*event_facts(events), *step_facts(points, progress),
             *checkpoint_facts(checkpoints), *resize_facts(job.resize_log),
             *restart_facts(job.restart_log)]
    live = not job.state.is_terminal
    end = now if live else (job.finished_at or job.state_since or now)
    return account(job.created_at, end, facts, live, reason=None if created else TRIMMED)
