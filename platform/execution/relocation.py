"""The controller's side of a relocation: a job whose survivors keep their work lost
a replica's node (or that node is draining), and asks the scheduler for other GPUs
for that replica.

The exchange runs on the job record, as a grow's does the other way round:

1. The controller writes `relocate: {replicas, avoid, requested_at}` (and
   `prefer`: the nodes holding its standby spares) on its job (RECOVERING after a
   loss, RUNNING for a drain's planned move) and wakes the scheduler.
2. The scheduler's next cycle answers it first (platform/scheduling/plugins/relocation.py):
   `placed` (the new slots, added to the job's placement with ranks past its world,
   so that no other job is placed on them) or `refused` (why).
3. The controller starts fresh ranks there, which take the survivors' state in the
   next generation (resize.py, `after_loss` and `move_off`). The generation's commit rewrites the
   placement without the lost slots and clears the request.

The controller waits `RELOCATE_WAIT_S` at most: the scheduler answers within a cycle
of being woken (half a second when idle). Without an answer, it withdraws the request
(slots placed late go with it) and the job goes back to the queue, as it did before
relocations: no job waits longer than that for a node.

A refusal of a lost replica is asked again every `ASK_AGAIN_S` until then (the
request reopened, `asked_again` counting): the job would wait in the queue for the
same GPUs it lacks, but there without its survivors' work. A node that is coming
back, or joining, is often minutes from being needed and seconds from being
there: in bench/goodput.py's chaos run (2026-12-06) a raylet killed 10 s after a
drained node was restarted was refused at once ("0 of 1 GPUs free": the node had
not joined yet), the job went back to the queue, and 0.6 s later was admitted on
that node, having lost 14 s and a step instead of about one second. Only the
first refusal is an event. A drain's planned move is not asked again: its job
trains on meanwhile, and its deadline is better spent on the requeue's checkpoint.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from kuangchao.platform.jobs.state import JobRecord, JobState, PlacedRank

RELOCATE_WAIT_S = 15.0
POLL_S = 0.05
ASK_AGAIN_S = 0.5  # a lost replica's refused request reopened this often, within the wait


@dataclasses.dataclass(frozen=True)
class Answer:
    """The scheduler's answer: the new slots (in the plan's rank order), or why not."""

    slots: tuple[PlacedRank, ...] = ()
    why_not: str = ""


def ask(store: Any, job_id: str, replicas: list[int], avoid: list[str],
        wait_s: float = RELOCATE_WAIT_S, clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep, planned: bool = False,
        prefer: list[str] | None = None) -> Answer:
    """Ask the scheduler to place `replicas` (by index) off the nodes in `avoid`; wait
    for its answer at most `wait_s`. `planned`: a drain's move of a RUNNING job, else
    the job is RECOVERING from a loss. `prefer`: nodes to place on first where the
    replicas fit (those holding the job's standby spares, standby.py)."""
    state = JobState.RUNNING if planned else JobState.RECOVERING
    at = round(time.time(), 6)
    message = (f"asking the scheduler to place {len(replicas)} replica(s) "
               f"{'on' if planned else 'lost with'} {', '.join(avoid) or 'their node'} elsewhere")

    def put(j: JobRecord):
        if j.state is not state or j.relocate:
            return None
        req = {"replicas": list(replicas), "avoid": list(avoid), "requested_at": at}
        if prefer:
            req["prefer"] = [n for n in prefer if n not in avoid]
        return dataclasses.replace(j, relocate=req), {
            "type": "relocation_requested", "message": message}

    if store.update(job_id, put) is None:
        return Answer(why_not=f"the job is no longer {state.value} (or has a request open)")
    store.wake_scheduler(job_id)
    deadline = clock() + wait_s
    refused_at: float | None = None
    while True:
        job = store.get(job_id)
        req = job.relocate or {}
        if req.get("requested_at") != at:
            return Answer(why_not="the request was withdrawn")
        if job.state is not state:  # cancelled, say, while it waited for room
            withdraw(store, job_id, at)
            return Answer(why_not=f"the job is no longer {state.value}")
        if "placed" in req:
            return Answer(slots=tuple(PlacedRank.from_json(d) for d in req["placed"]))
        now = clock()
        if "refused" in req:
            if planned or now + ASK_AGAIN_S >= deadline:
                withdraw(store, job_id, at)
                tries = int(req.get("asked_again") or 0)
                return Answer(why_not=str(req["refused"]) + (
                    f" (asked {tries + 1} times in {wait_s:.0f}s)" if tries else ""))
            if refused_at is None:
                refused_at = now
            elif now - refused_at >= ASK_AGAIN_S:
                ask_again(store, job_id, at, state)
                refused_at = None
        elif now >= deadline:
            withdraw(store, job_id, at)
            return Answer(why_not=f"the scheduler did not answer within {wait_s:.0f}s")
        sleep(POLL_S)


def ask_again(store: Any, job_id: str, at: float, state: JobState) -> None:
    """Reopen the refused request of `at` for the scheduler's next cycle, and wake it,
    while the job is still in `state`."""
    def reopen(j: JobRecord):
        req = j.relocate
        if j.state is not state or not req or req.get("requested_at") != at or "refused" not in req:
            return None
        again = {k: v for k, v in req.items() if k not in ("refused", "answered_at")}
        again["asked_again"] = int(req.get("asked_again") or 0) + 1
        return dataclasses.replace(j, relocate=again), None
    if store.update(job_id, reopen) is not None:
        store.wake_scheduler(job_id)


def withdraw(store: Any, job_id: str, at: float | None = None) -> None:
    """Drop the job's relocation request (that of `at`, or any) and the slots placed for it."""
    def drop(j: JobRecord):
        req = j.relocate
        if not req or (at is not None and req.get("requested_at") != at):
            return None
        return dataclasses.replace(j, relocate=None, placement=tuple(
            p for p in j.placement if p.rank < j.world_size)), None
    store.update(job_id, drop)
