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
of being woken (half a second when idle). Without an answer, or with a refusal, it
withdraws the request (slots placed late go with it) and the job goes back to the
queue, as it did before relocations: no job waits longer than that for a node.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from kuangchao.platform.jobs.state import JobRecord, JobState, PlacedRank

RELOCATE_WAIT_S = 15.0
POLL_S = 0.05


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
    while True:
        req = store.get(job_id).relocate or {}
        if req.get("requested_at") != at:
            return Answer(why_not="the request was withdrawn")
        if "placed" in req:
            return Answer(slots=tuple(PlacedRank.from_json(d) for d in req["placed"]))
        if "refused" in req:
            withdraw(store, job_id, at)
            return Answer(why_not=str(req["refused"]))
        if clock() >= deadline:
            withdraw(store, job_id, at)
            return Answer(why_not=f"the scheduler did not answer within {wait_s:.0f}s")
        sleep(POLL_S)


def withdraw(store: Any, job_id: str, at: float | None = None) -> None:
    """Drop the job's relocation request (that of `at`, or any) and the slots placed for it."""
    def drop(j: JobRecord):
        req = j.relocate
        if not req or (at is not None and req.get("requested_at") != at):
            return None
        return dataclasses.replace(j, relocate=None, placement=tuple(
            p for p in j.placement if p.rank < j.world_size)), None
    store.update(job_id, drop)
