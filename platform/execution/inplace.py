"""Replacing one failed rank in place, the survivors keeping their processes.

When the failure policy says REPLACE (a rank died, expired or hung on a node
that is still there and not quarantined), the failed rank is killed (a hung or
stopped one with SIGKILL), so survivors waiting on it in a collective fail out
of it within moments. They leave the process group and, with a warm spare or
a fresh actor in the failed rank's bundle, meet at a new rendezvous and
resume from the newest checkpoint without re-importing anything.
"""

from __future__ import annotations

import time
from typing import Any

from kuangchao.platform.errors import Cancelled, KuangchaoError
from kuangchao.platform.execution.recovery import Failure
from kuangchao.platform.jobs.state import PlacedRank, start
from kuangchao.platform.spec.jobspec import JobSpec


class InPlaceReplacement:
    """Replaces a rank of one job over its worker group.

    Args:
        store: The job store.
        job_id: The job.
        group: The worker group.
        formation: Records the new processes and forms the next generation.
    """

    def __init__(self, store: Any, job_id: str, group: Any, formation: Any) -> None:
        self.store, self.job_id, self.group, self.formation = store, job_id, group, formation

    def replace(self, failure: Failure, slot: PlacedRank | None, spec: JobSpec) -> bool:
        """Replace `failure.rank`; False (the job stays RECOVERING, to be placed again)
        when the survivors do not all stop within `stop_grace_s`, another rank died,
        or the new group cannot form."""
        rank = failure.rank
        assert rank is not None
        t0 = time.monotonic()
        watch = self.formation.watch
        self.group.stop(rank, watch.hosts.get(rank) if watch else None,
                        slot.node_id if slot else None, hard=failure.kind != "died")
        # A warm spare takes over at once; else a new actor starts now, and its
        # start-up overlaps the survivors' stop.
        spare = self.group.replace(rank, slot)
        survivors = [r for r in range(self.group.world) if r != rank]
        if not self.group.survivors_stopped(survivors, spec.fault_tolerance.stop_grace_s):
            return False
        try:
            self.group.reset(survivors)
            stopped_s = time.monotonic() - t0
            infos = self.group.describe(60.0)
        except Cancelled:
            raise
        except KuangchaoError:
            return False
        self.formation.record(infos)
        self.formation.form(infos)
        node = slot.node if slot else ""
        self.store.update(self.job_id, lambda j: start(
            j, f"rank {rank} replaced in place on {node}; {len(survivors)} survivor(s) kept "
               "their processes"))
        self.store.annotate_restart(self.job_id, {
            "path": "in_place", "spare": spare, "teardown_s": round(stopped_s, 3),
            "placement_s": round(time.monotonic() - t0 - stopped_s, 3)})
        return True
