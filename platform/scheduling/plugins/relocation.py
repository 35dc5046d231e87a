"""Relocation: a running job lost a node (or one is draining), and its survivors keep
their work.

Such a job (`JobSpec.survivors_keep_work`) need not go back to the queue when a
node under one of its replicas is lost or drained: its controller asks, on the job record
(`relocate`, platform/execution/relocation.py), for that many replicas to be placed
elsewhere, and re-forms its group at the same size with fresh ranks there that take
the survivors' state (platform/execution/resize.py). This plugin answers the ask.

- **First in the cycle.** A relocation is answered before any queued job is
  admitted. The job was admitted once and holds the rest of its GPUs; sent back
  to the queue instead, its survivors' work is lost and it is placed again anyway.
  Its data-parallel size, and so its GPU count, does not change, so its queue's
  quota is not asked again.
- **Where.** The replicas are placed by the same solver as any job, as one
  unit of the job's shape, on its own GPU type (grow_nodes), never on a node
  the controller saw lost (`avoid`: Ray may still list it alive for seconds).
  Nodes the request `prefer`s (where the job keeps standby spares) are tried
  first; when the replicas do not fit there, any node is.
- **Refused** when nothing fits: the controller then sends the job back to the queue
  as before, where it waits for GPUs like any other.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kuangchao.platform.jobs.state import JobRecord, JobState
from kuangchao.platform.placement.solver import PlacementPlan, place
from kuangchao.platform.scheduling.plugins.cycle import Cycle
from kuangchao.platform.scheduling.plugins.decisions import Relocate
from kuangchao.platform.scheduling.plugins.elastic import grow_nodes
from kuangchao.platform.scheduling.plugins.snapshot import JobView

# A job recovering from a lost node, or running and moving off a draining one.
RELOCATING = frozenset({JobState.RECOVERING, JobState.RUNNING})


def open_request(record: JobRecord) -> dict[str, Any] | None:
    """The job's relocation request still waiting for an answer, or None."""
    req = record.relocate
    if (record.state not in RELOCATING or not isinstance(req, dict)
            or "placed" in req or "refused" in req):
        return None
    return req


class LostReplicaRelocation:
    """Place the replicas a running job lost with a node on other nodes, or say why not."""

    name = "relocate"

    def place(self, job: JobView, cycle: Cycle) -> Relocate | None:
        """The answer to the job's open request; None when it has none."""
        req = open_request(job.record)
        if req is None:
            return None
        at = float(req.get("requested_at") or 0.0)
        count = len(req.get("replicas") or ())
        if count < 1:
            return Relocate(job.id, at, "the request names no replica to place")
        avoid = set(req.get("avoid") or ())
        nodes = tuple(n for n in grow_nodes(job, cycle) if n.name not in avoid)
        if not nodes:
            return Relocate(job.id, at, "no node of the job's GPU type is left to place on")
        shape = replace(job.shape, dp=count)
        # The nodes holding the job's standby spares first (platform/execution/standby.py):
        # a warm process there adopts the new rank, instead of one starting from nothing.
        prefer = set(req.get("prefer") or ()) - avoid
        plan = place(tuple(n for n in nodes if n.name in prefer), cycle.blocked(), shape,
                     job.traffic) if prefer else None
        if not isinstance(plan, PlacementPlan):
            plan = place(nodes, cycle.blocked(), shape, job.traffic)
        if not isinstance(plan, PlacementPlan):
            return Relocate(job.id, at, f"{count} replica(s) do not fit elsewhere now: "
                                        f"{plan.reason}")
        where = ", ".join(sorted({s.node for s in plan.slots}))
        return Relocate(job.id, at, f"{count} replica(s) placed on {where}, off "
                                    f"{', '.join(sorted(avoid)) or 'their node'}; the survivors "
                                    "keep their work", plan=plan)

    def decide(self, running: tuple[JobRecord, ...], cycle: Cycle) -> list[Relocate]:
        """Every open request among the running jobs, each applied to the ledger before
        the next is placed (a placed relocation takes GPUs)."""
        out: list[Relocate] = []
        for record in running:
            if open_request(record) is None:
                continue
            step = self.place(cycle.job(record.id), cycle)
            if step is not None:
                cycle.apply(step)
                out.append(step)
        return out
