"""Warm spare processes: one per node a job uses, to replace a failed rank at once.

A spare has imported everything a rank needs but holds no rank; when a rank on
its node fails, the spare adopts that rank (its token, GPUs and heartbeat)
instead of a fresh actor starting from nothing (`spare_workers`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kuangchao.platform.execution.grants import worker_settings
from kuangchao.platform.settings import Settings
from kuangchao.workers.runtime.rank_actor import SpareActor

SPARE_WAIT_S = 60.0


VIEW_TTL_S = 5.0


class SparePool:
    """The warm spares of one job, by Ray node id."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.by_node: dict[str, Any] = {}
        self._store: Any = None
        self._view: tuple[float, dict[str, dict[str, Any]]] | None = None

    def hardware(self, node: str) -> dict[str, Any] | None:
        """This node's entry of `node_hardware_view` with the operator's overrides, read from the job store.

        The node view is read once and kept for VIEW_TTL_S: a job's ranks start in one
        burst, and one `ray.nodes()` plus two Redis reads per rank would grow start-up
        with the job's size."""
        if self._store is None and self.settings.redis_url:
            from kuangchao.platform.jobs.store import JobStore

            self._store = JobStore.from_url(self.settings.redis_url, self.settings.redis_prefix)
        now = time.monotonic()
        if self._view is None or now - self._view[0] > VIEW_TTL_S:
            self._view = (now, node_hardware_view(self._store))
        return self._view[1].get(node)

    def keep(self, node_ids: set[str]) -> None:
        """Start a spare on each of these nodes that has none."""
        for node_id in node_ids - set(self.by_node):
            self.by_node[node_id] = ray.remote(SpareActor).options(
                num_cpus=0, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()

    def take(self, node_id: str, grant: Callable[[], dict[str, Any]], rank: dict[str, Any]) -> Any:
        """The spare on `node_id`, made the rank `rank` describes; None when there is none.

        `rank` holds job_id, rank, world_size, gpu_ids, node, heartbeat, authority and
        hardware (`node_hardware_view`); `grant` fetches the rank's fresh credentials.
        """
        spare = self.by_node.pop(node_id, None)
        if spare is None:
            return None
        # A spare still warming up is further along than a fresh actor would be.
        ready, _ = ray.wait([spare.__ray_ready__.remote()], timeout=SPARE_WAIT_S)
        if not ready:
            kill_actor(spare)
            return None
        try:
            token = grant()
            ray.get(spare.adopt.remote(rank["job_id"], rank["rank"], rank["world_size"],
                                       worker_settings(self.settings, token), rank["gpu_ids"],
                                       rank["node"], rank["heartbeat"], token, rank["authority"],
                                       hardware=rank.get("hardware")),
                    timeout=30)
        except ray.exceptions.RayError:
            kill_actor(spare)
            return None
        return spare

    def close(self) -> None:
        for spare in self.by_node.values():
            kill_actor(spare)
        self.by_node = {}


def kill_actor(actor: Any) -> None:
    """Kill an actor without a restart; one already gone is fine."""
    if actor is None:
        return
    try:
        ray.kill(actor, no_restart=True)
    except Exception:
        pass


def node_hardware_view(store: Any = None) -> dict[str, dict[str, Any]]:
    """Each node's `gpu_type` and `emulated_speed` from the scheduler's node view, for the
    ranks placed there (a spare adopting a rank on another node type takes that node's):
    a rank's speed decides its share of the work. A node missing from the view (or no
    view at all) gives its ranks no hardware; they then read KC_GPU_TYPE / KC_EMULATED_SPEED."""
    from kuangchao.platform.cluster.registry import current_nodes

    try:
        nodes = current_nodes(store)
    except Exception:  # the view is an optimisation of the split; the rank still runs
        return {}
    return {n.name: {"gpu_type": n.gpu_type, "emulated_speed": n.emulated_speed} for n in nodes}
