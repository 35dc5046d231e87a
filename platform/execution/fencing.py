"""Fencing the processes a failure's recovery replaces (docs/fault-tolerance.md, 'Fencing').

A rank declared lost may still be alive: on a node cut off from the network,
or from Redis alone, its process runs on, and writes again once the network
heals. Before anything takes its place the controller records it in the job's
fence set (platform/jobs/fences.py), which the job's ranks may read but not
change, and names it in a `fenced` event. A rank whose lease has lapsed reads
the set before it writes anything, and exits when it finds itself there
(workers/fence.py); the controller's heartbeat watch ignores beats from a
fenced process, or from any process but the one placed at the rank.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from kuangchao.platform.execution.recovery import Failure
from kuangchao.platform.jobs.fences import member
from kuangchao.platform.jobs.state import PlacedRank

log = logging.getLogger(__name__)


def replaced_by(failure: Failure, placement: tuple[PlacedRank, ...]) -> list[PlacedRank]:
    """The placed processes recovering from `failure` replaces: every rank on a lost
    node, else the failed rank's process (known only once it has started)."""
    if failure.kind == "node_lost" and failure.node_id:
        return [p for p in placement if p.node_id == failure.node_id and p.pid is not None]
    return [p for p in placement
            if p.rank == failure.rank and p.pid is not None and p.pid == failure.pid]


def fence_failed(store: Any, job_id: str, failure: Failure, quiet: bool = False
                 ) -> list[PlacedRank]:
    """Fence what `failure`'s recovery replaces, with a `fenced` event (`quiet`: none yet,
    the failure's final form names them all); returns them.

    Best effort: with Redis away, the watch's own check (a beat counts only from
    the process placed at its rank) still holds, and the failure goes on."""
    try:
        placement = store.get(job_id).placement
        slots = replaced_by(failure, placement)
        if not slots:
            return []
        store.fence(job_id, [member(p.pid, p.node) for p in slots if p.pid is not None])
        if quiet:
            return slots
        pids = ", ".join(f"rank {p.rank} pid {p.pid} on {p.node}" for p in slots)
        store.add_event(job_id, {
            "ts": time.time(), "type": "fenced", "node": failure.node,
            "ranks": [p.rank for p in slots], "pids": [p.pid for p in slots],
            "message": f"fenced {pids}: replaced after '{failure.kind}'; whatever these "
                       "processes write from now on is refused, and they exit once they read it"})
        log.warning("job %s: fenced %s (%s)", job_id, pids, failure.kind)
        return slots
    except redis.RedisError as exc:
        log.warning("job %s: could not fence the processes of rank %s: %s", job_id, failure.rank,
                    exc)
        return []
