"""The FIFO policy: strict first-in-first-out gang admission, one queue, no preemption."""

from __future__ import annotations

import time
from dataclasses import replace

from kuangchao.platform.placement.solver import Infeasible, PlacementPlan, place
from kuangchao.platform.scheduling.plugins.cycle import Cycle
from kuangchao.platform.scheduling.plugins.decisions import Admit, Decision, Wait
from kuangchao.platform.scheduling.plugins.relocation import LostReplicaRelocation, open_request
from kuangchao.platform.scheduling.plugins.snapshot import JobView, Snapshot, plan_gpus, union


class FifoPolicy:
    """Jobs in arrival order; a job that does not fit blocks the ones behind it,
    so a large job is never starved by a stream of small ones."""

    name = "fifo"

    def decide(self, snap: Snapshot) -> list[Decision]:
        used = snap.used_gpus()
        out: list[Decision] = []
        if any(open_request(j) for j in snap.active):
            # A running job's lost replicas first (relocation.py), as under the gang policy.
            cycle = Cycle(snap)
            out.extend(LostReplicaRelocation().decide(snap.active, cycle))
            used = cycle.blocked()
        blocked_by: str | None = None
        for job in sorted(snap.queued, key=lambda j: (j.created_at, j.id)):
            if blocked_by is not None:
                out.append(Wait(job.id, f"behind job {blocked_by} in the FIFO queue"))
                continue
            decision = self._admit(snap.view(job), snap, used)
            if isinstance(decision, Wait):
                blocked_by = job.id
            else:
                used = union(used, plan_gpus(decision.plan))
            out.append(decision)
        return out

    @staticmethod
    def _admit(job: JobView, snap: Snapshot, used: dict[str, set[int]]) -> Admit | Wait:
        """The largest size up to its target that places, else why not."""
        rng = job.rng
        result: PlacementPlan | Infeasible = Infeasible("no admissible size")
        started = time.perf_counter()
        for n in rng.sizes(upto=rng.target(job.record.desired_replicas)):
            result = place(snap.nodes, used, replace(job.shape, dp=n))
            if isinstance(result, PlacementPlan):
                return Admit(job.id, result, n, time.perf_counter() - started)
        return Wait(job.id, result.reason)
