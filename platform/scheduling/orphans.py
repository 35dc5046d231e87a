"""Jobs whose controller is gone: found by the scheduler and recovered.

A controller actor that dies is restarted by Ray and recovers its own job.
This check is the backstop for when that cannot happen (the restart budget
is spent, or the head node was lost with it): a job that holds resources
but whose controller has not existed for `ORPHAN_AFTER_S` is recorded as a
`controller` failure and requeued, to resume from its newest checkpoint.
Every check reads Redis afresh, so a restarted scheduler picks up where the
last one left off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kuangchao.platform.execution.recovery import Failure, record_failure, requeue_for_recovery
from kuangchao.platform.jobs.claims import controller_name
from kuangchao.platform.jobs.state import JobState
from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.settings import Settings
from kuangchao.platform.spec.stored import spec_of

log = logging.getLogger(__name__)

RECONCILE_S = 5.0
ORPHAN_AFTER_S = 20.0


class OrphanCheck:
    """Tracks, across checks, since when each running job's controller has been missing."""

    def __init__(self, store: JobStore, settings: Settings,
                 exists: Callable[[str], bool], clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.settings, self.exists, self.clock = store, settings, exists, clock
        self.missing_since: dict[str, float] = {}

    def check(self) -> list[str]:
        """One pass; returns the ids of the jobs it sent back to the queue."""
        now = self.clock()
        recovered, seen = [], set()
        for job in self.store.list_active():
            if job.driver != "scheduler" or not job.state.holds_resources:
                continue
            name = controller_name(self.store.controller(job.id))
            if name and self.exists(name):
                continue
            seen.add(job.id)
            since = self.missing_since.setdefault(job.id, now)
            if now - since < ORPHAN_AFTER_S:
                continue
            log.warning("job %s: controller %s is gone; recovering the job", job.id, name)
            max_restarts = spec_of(job.spec).fault_tolerance.max_restarts
            failure = Failure("controller", f"the job's controller {name or '(none)'} is gone; "
                                            "recovering from the newest checkpoint")
            if job.state is JobState.RECOVERING or record_failure(
                    self.store, job.id, failure, max_restarts, self.settings.quarantine):
                requeue_for_recovery(self.store, job.id, 0.0)
            recovered.append(job.id)
        self.missing_since = {k: v for k, v in self.missing_since.items() if k in seen}
        return recovered
