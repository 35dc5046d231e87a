"""The Ray actor classes of a rank, cheap to import.

The controller creates rank actors but runs none: importing the worker itself
(torch, distributed checkpointing, the trainer) took 2.5 s of CPU in every new
controller, on the path from admission to the first step. These shells name
the methods the controller calls; the worker is imported and built inside the
actor's own process, where it is needed anyway.
"""

from __future__ import annotations

from typing import Any


class RankActor:
    """One rank's actor: a `TrainWorker` built in the actor's process."""

    def __init__(self, job_id: str, rank: int, world_size: int, settings: Any,
                 planned_gpus: Any = None, node: str = "", heartbeat: Any = None,
                 grant: dict[str, Any] | None = None, *args: Any, **kwargs: Any) -> None:
        from kuangchao.workers.runtime.reach import check_control_plane

        # First, before anything waits on them: can this node reach Redis and the head?
        check_control_plane(rank, node, (grant or {}).get("redis_url") or settings.redis_url)
        from kuangchao.workers.runtime.worker import TrainWorker

        self.worker = TrainWorker(job_id, rank, world_size, settings, planned_gpus, node,
                                  heartbeat, grant, *args, **kwargs)

    def describe(self) -> dict[str, Any]:
        return self.worker.describe()

    def join(self, *args: Any, **kwargs: Any) -> str:
        return self.worker.join(*args, **kwargs)

    def run(self, spec_doc: dict[str, Any], keepers: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.worker.run(spec_doc, keepers)

    def reset(self) -> None:
        self.worker.reset()


class SpareActor(RankActor):
    """A warm spare's actor: a `SpareWorker` that has imported the trainer and
    waits to `adopt` a failed rank on its node."""

    def __init__(self) -> None:  # noqa: D107 -- the rank comes later, with `adopt`
        from kuangchao.workers.runtime.warm_up import warm

        # torch, the worker and the trainer, imported and exercised at background
        # priority: importing them here in Ray's thread would take the ranks' CPU.
        warm()
        from kuangchao.workers.runtime.worker import SpareWorker

        self.worker = SpareWorker()

    def adopt(self, *args: Any, **kwargs: Any) -> int:
        return self.worker.adopt(*args, **kwargs)

    def reaches(self, host: str, port: int, timeout_s: float) -> str:
        """The controller's node probe, run by a process already up on the node:
        the error of a TCP connection from here to host:port, or '' (reachability.py)."""
        from kuangchao.workers.runtime.reach import connect_error

        return connect_error(host, port, timeout_s)
