"""The scheduler's snapshot, kept across cycles and updated from what changed.

Rebuilding the snapshot each cycle resolves every job's spec again, regathers
every placement into per-node GPU sets and re-sorts the queue: at 10,000
queued jobs that alone costs hundreds of milliseconds, every cycle, for a
cluster where a cycle typically changes a handful of jobs. The keeper instead
remembers, from the last cycle, each job's record version, its resolved view,
the GPUs held per node (as counts, so two records naming one GPU cannot make
it free early) and the queue in policy order; a new cycle's records are
compared by (id, version), and only jobs admitted, finished, queued, requeued
or otherwise edited since are applied. The store bumps a record's version on
every write, so an unchanged version means an unchanged record.

So that it can never drift for long, the keeper rebuilds everything from the
records every `rebuild_every` cycles, and at once when the versions it sees
cannot be right (one went backwards: the store was reset or a record
re-created) or when most jobs changed anyway. A scheduled rebuild also
compares its result with the incremental state and counts any difference
(`drifts`), which should stay 0.

Nodes are not kept: the node view is re-read each cycle (nodes join, are lost,
drain or are quarantined) and is cheap to take as it is; the held GPUs are by
node name, so a node that comes back finds its GPUs as its jobs left them.

Pure: records in, a `Snapshot` out; no store, Ray or Redis.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable

from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.jobs.state import JobRecord, JobState
from kuangchao.platform.scheduling.plugins.snapshot import JobView, Snapshot, order_key
from kuangchao.platform.spec.queues import QueueTable

log = logging.getLogger(__name__)

REBUILD_EVERY = 200  # cycles; at the scheduler's 0.5 s pace, a full rebuild every ~100 s


def _relevant(job: JobRecord) -> bool:
    """Whether a policy reads this job: queued, or holding GPUs."""
    return job.state is JobState.QUEUED or job.state.holds_resources


class SnapshotKeeper:
    """One scheduler's snapshot, refreshed each cycle by `refresh`.

    Args:
        rebuild_every: Cycles between full rebuilds (1: rebuild every cycle,
            the old behaviour).
        rebuild_share: Rebuild instead when more than this share of the jobs
            changed or left since the last cycle.
    """

    def __init__(self, rebuild_every: int = REBUILD_EVERY, rebuild_share: float = 0.5) -> None:
        self.rebuild_every = max(1, rebuild_every)
        self.rebuild_share = rebuild_share
        self.rebuilds = 0  # full rebuilds so far, the first one included
        self.drifts = 0  # scheduled rebuilds that found the incremental state wrong
        self.changed = 0  # jobs applied incrementally by the last refresh
        self._since_rebuild = 0
        self._reset()

    def _reset(self) -> None:
        self._jobs: dict[str, JobRecord] = {}  # every relevant job as last seen
        self._views: dict[str, JobView] = {}
        self._counts: dict[str, dict[int, int]] = {}  # node -> gpu -> holders
        self._held: dict[str, frozenset[int]] = {}  # node -> GPUs held (the counts' keys)
        self._order: list[tuple[tuple, str]] = []  # queued jobs, (order_key, id), sorted

    def refresh(self, nodes: tuple[NodeInfo, ...], jobs: Iterable[JobRecord],
                queues: QueueTable | None = None) -> Snapshot:
        """This cycle's snapshot from the store's active records (`list_active`)."""
        current = {j.id: j for j in jobs if _relevant(j)}
        self._since_rebuild += 1
        reason = self._rebuild_reason(current)
        if reason is not None:
            self._rebuild(current, reason)
        else:
            self._apply(current)
        return self._snapshot(nodes, queues or QueueTable())

    def rebuild_snapshot(self, nodes: tuple[NodeInfo, ...], jobs: Iterable[JobRecord],
                         queues: QueueTable | None = None) -> Snapshot:
        """A snapshot rebuilt from the records alone, whatever the keeper holds."""
        self._rebuild({j.id: j for j in jobs if _relevant(j)}, "asked")
        return self._snapshot(nodes, queues or QueueTable())

    # -- deciding how ---------------------------------------------------------------
    def _rebuild_reason(self, current: dict[str, JobRecord]) -> str | None:
        if self.rebuilds == 0:
            return "first cycle"
        if self._since_rebuild >= self.rebuild_every:
            return "scheduled"
        changed = kept = 0
        for job_id, job in current.items():
            old = self._jobs.get(job_id)
            if old is None:
                changed += 1
                continue
            kept += 1
            if job.version < old.version:
                return f"job {job_id} went from version {old.version} to {job.version}"
            if job.version != old.version or job.version == 0:
                changed += 1
        gone = len(self._jobs) - kept
        if changed + gone > self.rebuild_share * max(len(current), 1):
            return "most jobs changed"  # a rebuild costs no more, and starts clean
        return None

    # -- incremental ------------------------------------------------------------------
    def _apply(self, current: dict[str, JobRecord]) -> None:
        """Apply only what changed since the last cycle: by (id, version); a
        version of 0 (a record that never went through a store) always counts as changed."""
        changed = 0
        for job_id, old in list(self._jobs.items()):
            if job_id not in current:
                self._forget(old)
                changed += 1
        for job_id, job in current.items():
            old = self._jobs.get(job_id)
            if old is not None and old.version == job.version and job.version != 0:
                continue
            if old is not None:
                self._forget(old)
            self._learn(job, JobView.of(job))
            changed += 1
        self.changed = changed

    def _learn(self, job: JobRecord, view: JobView) -> None:
        self._jobs[job.id] = job
        self._views[job.id] = view
        if job.state is JobState.QUEUED:
            bisect.insort(self._order, (order_key(job), job.id))
        if job.state.holds_resources:
            self._count(job, +1)

    def _forget(self, job: JobRecord) -> None:
        del self._jobs[job.id]
        del self._views[job.id]
        if job.state is JobState.QUEUED:
            entry = (order_key(job), job.id)
            i = bisect.bisect_left(self._order, entry)
            if i < len(self._order) and self._order[i] == entry:
                del self._order[i]
        if job.state.holds_resources:
            self._count(job, -1)

    def _count(self, job: JobRecord, sign: int) -> None:
        touched = set()
        for p in job.placement:
            counts = self._counts.setdefault(p.node, {})
            for g in p.gpus:
                n = counts.get(g, 0) + sign
                if n > 0:
                    counts[g] = n
                else:
                    counts.pop(g, None)
            touched.add(p.node)
        for node in touched:
            if self._counts.get(node):
                self._held[node] = frozenset(self._counts[node])
            else:
                self._counts.pop(node, None)
                self._held.pop(node, None)

    # -- full rebuild ----------------------------------------------------------------
    def _rebuild(self, current: dict[str, JobRecord], reason: str) -> None:
        before = None
        if reason == "scheduled":
            # Nothing forced this one: bring the incremental state up to date first,
            # so that any difference from the rebuild is a bookkeeping bug (drift).
            self._apply(current)
            before = (dict(self._held), list(self._order))
        self._reset()
        for job in current.values():
            self._jobs[job.id] = job
            self._views[job.id] = JobView.of(job)
            if job.state.holds_resources:
                self._count(job, +1)
        self._order = sorted((order_key(j), j.id) for j in current.values()
                             if j.state is JobState.QUEUED)
        self.rebuilds += 1
        self.changed = len(current)
        self._since_rebuild = 0
        if before is not None and before != (self._held, self._order):
            self.drifts += 1
            log.warning("scheduler snapshot had drifted from the records; rebuilt")
        log.debug("scheduler snapshot rebuilt: %s", reason)

    # -- output -----------------------------------------------------------------------
    def _snapshot(self, nodes: tuple[NodeInfo, ...], queues: QueueTable) -> Snapshot:
        jobs = self._jobs
        queued = tuple(jobs[job_id] for _, job_id in self._order)
        # The store's order (list_active: oldest first), whatever order jobs changed in.
        active = tuple(sorted((j for j in jobs.values() if j.state.holds_resources),
                              key=lambda j: (j.created_at, j.id)))
        # Shallow copies: the next refresh edits the keeper's maps, never this cycle's.
        return Snapshot(nodes=nodes, queued=queued, active=active, queues=queues,
                        resolved=dict(self._views), held=dict(self._held))
