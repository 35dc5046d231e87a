"""Turning what the controller sees into a `Failure`: a dead actor, or heartbeat verdicts.

The failure names the rank, its node and process, and how long detection
took; a rank whose node is gone is a `node_lost`, whatever the first sign was.
For heartbeat verdicts it first gathers every rank's stacks into the job's
events, so that a hang can be diagnosed after the rank is killed.

Every process the failure's recovery will replace is fenced before the failure
is returned (fencing.py): all the ranks of a lost node, else the failed rank's
own. A rank that went silent is fenced at once, before the stacks and the node
probe take their seconds: the sooner the fence is there, the smaller the window
in which a rank whose network healed meanwhile finds itself not fenced and
writes again (its next beat then finds the fence, docs/fault-tolerance.md).
"""

from __future__ import annotations

import time
from typing import Any

import redis

from kuangchao.platform.execution.fencing import fence_failed
from kuangchao.platform.execution.heartbeat import Verdict
from kuangchao.platform.execution.recovery import Failure
from kuangchao.platform.jobs.state import PlacedRank


class FailureDetector:
    """Failures of one job's ranks.

    Args:
        store: The job store (the placement, and the events the stacks go to).
        job_id: The job.
        group: The worker group (whether a node is lost).
        formation: Holds the current heartbeat watch.
    """

    def __init__(self, store: Any, job_id: str, group: Any, formation: Any,
                 redis: tuple[str, int] | None = None) -> None:
        self.store, self.job_id, self.group, self.formation = store, job_id, group, formation
        self.redis = redis  # where ranks send heartbeats, for the node probe

    def slot(self, rank: int) -> PlacedRank | None:
        try:
            job = self.store.get(self.job_id)
        except redis.RedisError:  # the store is away: the failure is reported without its place
            return None
        return next((p for p in job.placement if p.rank == rank), None)

    def died(self, rank: int, reason: str) -> Failure:
        """The failure of a rank whose actor died: its process, or its whole node."""
        now = time.time()  # the moment the death was seen, before any classification
        slot = self.slot(rank)
        place = f" on {slot.node} (pid {slot.pid})" if slot else ""
        kind = "node_lost" if slot and self.group.node_lost(slot.node_id) else "died"
        watch = self.formation.watch
        beat = watch.last_beat(rank) if watch else None
        failure = Failure(kind, f"rank {rank}{place} died: {reason}", rank=rank,
                          node=slot.node if slot else None, pid=slot.pid if slot else None,
                          detected_after_s=round(now - beat.ts, 3) if beat else None,
                          last_heartbeat_at=beat.ts if beat else None, failed_at=now,
                          node_id=slot.node_id if slot else None)
        # A dead actor may be a live process: Ray gives up on a node it cannot reach.
        fence_failed(self.store, self.job_id, failure)
        return failure

    def from_heartbeats(self, skip: set[int]) -> Failure | None:
        """The first rank the heartbeat watch judges failed, with stacks for the record.

        Ranks in `skip` have already returned from their train function.
        """
        watch = self.formation.watch
        if watch is None:
            return None
        verdicts = [v for v in watch.poll() if v.rank not in skip]
        if not verdicts:
            return None
        first = min(verdicts, key=lambda v: (v.kind != "expired", v.rank))
        failed_at = time.time()
        slot = self.slot(first.rank)
        if first.kind == "expired" and slot is not None:  # silent: it answers no stack request
            fence_failed(self.store, self.job_id, self._failure(first, "expired", "", slot,
                                                                failed_at), quiet=True)
        stacks = watch.collect_stacks([v.rank for v in verdicts],
                                      silent=[v.rank for v in verdicts if v.kind == "expired"])
        for rank, text in sorted(stacks.items()):
            self.store.add_event(self.job_id, {"type": "stacks", "rank": rank,
                                               "message": f"stacks of rank {rank}", "text": text})
        message = first.describe(watch.classifier.heartbeat_timeout_s)
        if "stopped" in stacks.get(first.rank, ""):
            message += "; its process is stopped"
        kind, unreachable = first.kind, None
        agent_node = watch.agent_gone(first.rank) if kind == "expired" else None
        if kind == "expired" and slot and self.group.node_lost(slot.node_id):
            kind, message = "node_lost", message + "; its node is gone"
        elif agent_node is not None:  # the node's part the controller watches is gone
            kind, unreachable = "node_lost", "agent"
            message += f"; the node agent on {agent_node} stopped writing its record"
        elif kind == "expired" and slot and slot.node_id and self.redis:
            # Alive to Ray, silent in Redis: ask the node whether it still reaches us.
            reach = self.group.reach(slot.node_id, self.redis)
            if reach.network_fault:
                kind, unreachable = "node_lost", "redis" if reach.answered else "network"
                message += "; " + reach.describe(slot.node, self.redis)
        failure = self._failure(first, kind, message, slot, failed_at, unreachable)
        fence_failed(self.store, self.job_id, failure)
        return failure

    @staticmethod
    def _failure(first: Verdict, kind: str, message: str, slot: PlacedRank | None,
                 failed_at: float, unreachable: str | None = None) -> Failure:
        beat = first.last
        return Failure(
            kind, message, rank=first.rank, node=slot.node if slot else None,
            pid=slot.pid if slot else None, detected_after_s=round(first.detected_after_s, 3),
            last_heartbeat_at=beat.ts if beat else None, failed_at=failed_at,
            node_id=slot.node_id if slot else None, unreachable=unreachable)
