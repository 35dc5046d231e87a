"""Quota: the sizes a queued job may be admitted at within its queue's share.

A queue may also limit the GPUs it holds per type (`gpu_types: {h100-80gb: 8}`).
Which types a job's GPUs will be is only known once it is placed, so the limit
is enforced in two steps: here, a job waits when no type it accepts has room
for its smallest size (for a mixed job: all of them together); and every
placement the scheduler makes for it is given the room left per type
(`Cycle.type_caps`), so the plan only takes GPUs of types with room.
"""

from __future__ import annotations

from dataclasses import dataclass

from kuangchao.platform.scheduling.plugins.cycle import Cycle
from kuangchao.platform.scheduling.plugins.decisions import Wait
from kuangchao.platform.scheduling.plugins.snapshot import JobView
from kuangchao.platform.spec.queues import Queue


@dataclass(frozen=True)
class Sizes:
    """Replica counts a job may take within its quota, largest first (never empty)."""

    sizes: tuple[int, ...]

    @property
    def least(self) -> int:
        return self.sizes[-1]


class QueueQuota:
    """A queue holds at most its limit (guarantee plus borrowing); the cluster at most its GPUs.

    An elastic job is offered the sizes up to its target (its `kc scale` size,
    else `max_replicas`) that stay within the quota, and at least its minimum.
    """

    name = "quota"

    def admissible(self, job: JobView, cycle: Cycle) -> Sizes | Wait:
        queues = cycle.snap.queues
        queue = queues.get(job.record.queue)
        if queue is None:
            return Wait(job.id, f"queue {job.record.queue!r} does not exist; known queues: "
                                f"{', '.join(queues.names)}")
        in_use = cycle.usage.get(queue.name, 0)
        rng = job.rng
        per = rng.gpus_per_replica
        sizes = rng.sizes(upto=rng.target(job.record.desired_replicas)) or [rng.min_replicas]
        fitting = tuple(n for n in sizes if in_use + n * per <= queue.limit)
        if not fitting:
            return Wait(job.id, f"quota {queue.name}: {in_use}/{queue.limit:g} GPUs in use")
        fitting = self._type_room(job, queue, fitting, cycle)
        if isinstance(fitting, Wait):
            return fitting
        # can never fit: it must not hold GPUs back from others
        never = cycle.never_fits(job.shape, fitting[-1] * per) if per else None
        if never is not None:
            return Wait(job.id, never)
        return Sizes(fitting)

    @staticmethod
    def _type_room(job: JobView, queue: Queue, sizes: tuple[int, ...],
                   cycle: Cycle) -> tuple[int, ...] | Wait:
        """The sizes some accepted type (a mixed job: all together) has per-type room for."""
        caps = cycle.type_caps(queue.name)
        per = job.rng.gpus_per_replica
        if not caps or not per:  # before the pools: most queues have no per-type limit
            return sizes
        pools = cycle.snap.pools(job.shape.gpu_types)
        if not pools:
            return sizes
        room = [caps.get(p.gpu_type or "", float("inf")) for p in pools]
        most = sum(room) if job.shape.heterogeneous else max(room)
        fitting = tuple(n for n in sizes if n * per <= most)
        if fitting:
            return fitting
        held = cycle.type_usage.get(queue.name, {})
        full = ", ".join(f"{p.name} {held.get(p.name, 0)}/{queue.gpu_types[p.name]}"
                         for p in pools if p.gpu_type in queue.gpu_types)
        return Wait(job.id, f"quota {queue.name}: {full} GPUs in use")

    def room(self, queue_name: str, gpus: int, cycle: Cycle) -> bool:
        """Whether `queue_name` may take `gpus` more GPUs (an unknown queue has no limit here)."""
        queue = cycle.snap.queues.get(queue_name)
        return queue is None or cycle.usage.get(queue_name, 0) + gpus <= queue.limit
