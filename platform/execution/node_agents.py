"""The node agents of one job: one small actor per node its ranks run on.

Each relays its node's heartbeats in one Redis record per interval
(workers/runtime/node_agent.py), on the job's own Redis user: the agent holds
no more than the job's ranks do. The controller starts them once its ranks
are placed (and again for nodes a replacement or a resize brings), and stops
them with the group.

Agents pay off with many ranks: one Redis write and one key to scan per node
instead of per rank. A job of a few ranks gains little and pays a process per
node, so `fault_tolerance.node_agents: auto` starts them from
relayed.AUTO_MIN_RANKS ranks on; `on` and `off` decide for the job.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kuangchao.platform.execution.relayed import agents_wanted
from kuangchao.platform.execution.spares import kill_actor
from kuangchao.platform.jobs.state import PlacedRank
from kuangchao.platform.spec.jobspec import JobSpec
from kuangchao.workers.runtime.node_agent import NodeAgentActor

log = logging.getLogger(__name__)

CHECK_S = 10.0  # how long a liveness check of the agents may take
STOP_S = 2.0  # how long the agents get to take their folders away


def heartbeat_args(spec: JobSpec) -> tuple[float, float, bool]:
    """What each rank's heartbeat is started with: period, TTL, and whether to relay."""
    ft = spec.fault_tolerance
    return ft.heartbeat_interval_s, ft.heartbeat_timeout_s, agents_wanted(spec)


class NodeAgents:
    """The agents of one job, by Ray node id.

    Args:
        job_id: The job.
        prefix: The job store's key prefix.
    """

    def __init__(self, job_id: str, prefix: str) -> None:
        self.job_id, self.prefix = job_id, prefix
        self.by_node: dict[str, tuple[str, Any]] = {}  # node id -> (node name, actor)

    def ensure(self, placement: Iterable[PlacedRank], spec: JobSpec, redis_url: str | None) -> None:
        """An agent on every node of `placement` that has none, or whose agent died."""
        if not redis_url or not agents_wanted(spec):
            return
        wanted = {p.node_id: p.node for p in placement if p.node_id}
        for node_id in self._dead(set(wanted) & set(self.by_node)):
            kill_actor(self.by_node.pop(node_id)[1])
        ft = spec.fault_tolerance
        for node_id, node in wanted.items():
            if node_id in self.by_node:
                continue
            actor = ray.remote(NodeAgentActor).options(
                num_cpus=0, max_restarts=0, name=None,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(redis_url, self.prefix, self.job_id, node, ft.heartbeat_interval_s,
                     ft.heartbeat_timeout_s)
            self.by_node[node_id] = (node, actor)

    def _dead(self, node_ids: set[str]) -> list[str]:
        """The nodes among these whose agent does not answer."""
        if not node_ids:
            return []
        ids = sorted(node_ids)
        refs = [self.by_node[n][1].info.remote() for n in ids]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=CHECK_S)
        dead = []
        for node_id, ref in zip(ids, refs, strict=True):
            try:
                if ref not in ready:
                    raise TimeoutError("no answer")
                ray.get(ref)
            except Exception as exc:  # noqa: BLE001 -- any failure means: start another
                log.warning("job %s: node agent on %s is gone (%s); starting another",
                            self.job_id, self.by_node[node_id][0], exc)
                dead.append(node_id)
        return dead

    def pids(self) -> dict[str, int]:
        """Each agent's process, by node name (for `kc debug` and tests)."""
        out = {}
        for node, actor in self.by_node.values():
            try:
                out[node] = ray.get(actor.info.remote(), timeout=CHECK_S)["pid"]
            except Exception:  # noqa: BLE001 -- a dead agent has no process to name
                continue
        return out

    def close(self) -> None:
        """Stop every agent (each takes its folder away), then make sure they are gone."""
        actors = [a for _, a in self.by_node.values()]
        self.by_node = {}
        if not actors:
            return
        refs = [a.stop.remote() for a in actors]
        ray.wait(refs, num_returns=len(refs), timeout=STOP_S)
        for actor in actors:
            kill_actor(actor)
