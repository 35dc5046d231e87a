"""Forming a job's process group, one generation at a time, and watching its ranks.

Every generation (the start, an in-place replacement, a resize) is published
under its own number at the one rendezvous store the worker group hosts, so a
slow rank of an old generation can never join a new one. Once the ranks are
in, `Formation` arms the heartbeat watch for exactly those ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from kuangchao.platform.errors import KuangchaoError
from kuangchao.platform.execution.relayed import agents_wanted
from kuangchao.platform.execution.watch import RankHost, RankWatch
from kuangchao.platform.jobs.state import JobRecord
from kuangchao.platform.protocol.generation import Generation
from kuangchao.platform.spec.jobspec import JobSpec

WatchFactory = Callable[..., Any]


class Formation:
    """The generations of one job and the watch over its current ranks.

    Args:
        store: The job store.
        job_id: The job.
        group: The worker group (its rendezvous, its ranks).
        watch_factory: Builds the heartbeat watch (`RankWatch`'s signature).
    """

    def __init__(self, store: Any, job_id: str, group: Any,
                 watch_factory: WatchFactory = RankWatch) -> None:
        self.store, self.job_id, self.group = store, job_id, group
        self.watch_factory = watch_factory
        self.gen = 0  # the generation last published
        self.watch: Any = None
        self.spec: JobSpec | None = None

    def begin(self, spec: JobSpec) -> None:
        """Continue the numbering of any earlier run of this job."""
        self.spec = spec
        self.gen = max(self.gen, int((self.store.generation(self.job_id) or {}).get("gen", 0)))

    def publish(self, ranks: dict[int, int], joining: tuple[int, ...], cause: str,
                signal: bool) -> Generation:
        """Publish the next generation of the group's current size."""
        assert self.spec is not None, "begin first"
        rng = self.spec.elastic_range
        world = self.group.world
        replicas = world // rng.ranks_per_replica
        host, port = self.group.rendezvous()
        self.gen += 1
        gen = Generation(gen=self.gen, world_size=world, replicas=replicas,
                         accum=rng.accumulation(replicas), host=host, port=port, ranks=ranks,
                         joining=joining, cause=cause, keepers=self.group.keeper_plan())
        self.store.publish_generation(self.job_id, gen.to_json(), signal)
        return gen

    def form(self, infos: list[dict[str, Any]]) -> str:
        """Watch heartbeats from here on, and form the process group at a fresh
        rendezvous; returns the backend."""
        self.watch_ranks(infos)
        gen = self.publish({r: r for r in range(self.group.world)}, (), "start", signal=False)
        return self.group.join(gen.to_json())

    def watch_ranks(self, infos: list[dict[str, Any]]) -> None:
        assert self.spec is not None, "begin first"
        ft = self.spec.fault_tolerance
        self.watch = self.watch_factory(
            self.store, self.job_id, list(range(len(infos))), ft.heartbeat_timeout_s,
            ft.hang_timeout_s, ft.heartbeat_interval_s,
            hosts={r: RankHost(i["pid"], i["ip"], i["host"]) for r, i in enumerate(infos)},
            nodes=self.nodes_of_ranks(len(infos)) if agents_wanted(self.spec) else None,
            peer_wait_s=ft.peer_wait_timeout_s)

    def nodes_of_ranks(self, world: int) -> dict[int, str]:
        """Rank -> the node it was placed on: where its node agent's record is read."""
        return {p.rank: p.node for p in self.store.get(self.job_id).placement
                if p.rank < world and p.node}

    def stop_watching(self) -> None:
        self.watch = None

    def record(self, infos: list[dict[str, Any]]) -> None:
        """Write each rank's process into the placement, after checking Ray kept the plan."""
        job = self.store.get(self.job_id)
        for slot, info in zip(job.placement, infos, strict=True):
            if slot.node_id and info["node_id"] != slot.node_id:
                raise KuangchaoError(
                    f"rank {slot.rank} was planned on {slot.node} but Ray started it on node "
                    f"{info['node_id'][:12]}; the placement group did not honour the plan")

        def update(j: JobRecord) -> tuple[JobRecord, dict[str, Any]]:
            placement = tuple(dataclasses.replace(p, pid=i["pid"])
                              for p, i in zip(j.placement, infos, strict=True))
            message = "; ".join(
                f"rank {p.rank} on {p.node} gpus {','.join(map(str, i['gpu_ids']))} pid {p.pid}"
                for p, i in zip(placement, infos, strict=True))
            return dataclasses.replace(j, placement=placement), {"type": "placement",
                                                                 "message": message}

        self.store.update(self.job_id, update)
        # Every start, replacement and resize comes here: an agent on each node now used.
        self.group.ensure_agents(self.store.get(self.job_id).placement)
