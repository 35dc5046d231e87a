"""Gang admission: a job is placed whole, at the largest size its quota allows that fits,
on GPU types its spec accepts and its queue has per-type room for."""

from __future__ import annotations

import time
from dataclasses import replace

from kuangchao.platform.placement.solver import Infeasible, PlacementPlan
from kuangchao.platform.scheduling.plugins.cycle import Cycle
from kuangchao.platform.scheduling.plugins.decisions import Admit
from kuangchao.platform.scheduling.plugins.quota import Sizes
from kuangchao.platform.scheduling.plugins.snapshot import JobView


class GangAdmission:
    """All of a job's ranks at once or none: the first of its sizes that places wins."""

    name = "gang"

    def place(self, job: JobView, sized: Sizes, cycle: Cycle) -> Admit | Infeasible:
        """An `Admit`, or why even its smallest size does not fit now."""
        per = job.rng.gpus_per_replica
        plan: PlacementPlan | Infeasible = Infeasible("no admissible size")
        caps = cycle.type_caps(job.record.queue)  # per-type quota: only types with room
        started = time.perf_counter()
        for n in sized.sizes:
            plan = cycle.try_place(replace(job.shape, dp=n), n * per, job.traffic, caps)
            if isinstance(plan, PlacementPlan):
                return Admit(job.id, plan, n, time.perf_counter() - started)
        return plan
