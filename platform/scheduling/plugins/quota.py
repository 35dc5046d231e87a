"""Quota: the sizes a queued job may be admitted at within its queue's share."""

from __future__ import annotations

from dataclasses import dataclass

from kuangchao.platform.scheduling.plugins.cycle import Cycle
from kuangchao.platform.scheduling.plugins.decisions import Wait
from kuangchao.platform.scheduling.plugins.snapshot import JobView


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
        if fitting[-1] * per > cycle.total:  # can never fit: it must not hold GPUs back from others
            return Wait(job.id, f"needs {fitting[-1] * per} GPUs, the cluster has {cycle.total}")
        return Sizes(fitting)

    def room(self, queue_name: str, gpus: int, cycle: Cycle) -> bool:
        """Whether `queue_name` may take `gpus` more GPUs (an unknown queue has no limit here)."""
        queue = cycle.snap.queues.get(queue_name)
        return queue is None or cycle.usage.get(queue_name, 0) + gpus <= queue.limit
