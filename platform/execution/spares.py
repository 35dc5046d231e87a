"""Warm spare processes: one per node a job uses, to replace a failed rank at once.

A spare has imported everything a rank needs but holds no rank; when a rank on
its node fails, the spare adopts that rank (its token, GPUs and heartbeat)
instead of a fresh actor starting from nothing (`spare_workers`). Standby
spares (`standby_spares`, standby.py) wait the same way on nodes the job does
not use, for a replica relocated there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import ray
import redis
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kuangchao.platform.cluster.quarantine import active, holds
from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.execution.grants import worker_settings
from kuangchao.platform.execution.standby import names_of, spare_entries, standby_nodes
from kuangchao.platform.settings import Settings
from kuangchao.platform.spec.jobspec import JobSpec
from kuangchao.workers.runtime.rank_actor import SpareActor

SPARE_WAIT_S = 60.0


VIEW_TTL_S = 5.0
STANDBY_CHECK_S = 5.0  # how often a running job chooses its standby nodes again


class SparePool:
    """The warm spares of one job, by Ray node id."""

    def __init__(self, settings: Settings, job_id: str = "") -> None:
        self.settings, self.job_id = settings, job_id
        self.by_node: dict[str, Any] = {}
        self._ready_refs: dict[str, tuple[Any, Any]] = {}  # node id -> (spare, its ready ref)
        self.own: set[str] = set()  # Ray node ids of the job's nodes, as keep() was last told
        self.standby: set[str] = set()  # Ray node ids of the standby spares' nodes
        self._standby_named: dict[str, str] = {}  # their names -> those ids
        self._checked = 0.0  # when tick() last chose them
        self._store: Any = None
        self._view: tuple[float, dict[str, dict[str, Any]]] | None = None
        self._published: tuple[dict[str, Any], ...] = ()  # the job record's `spares`
        self._seen: Any = None  # the states and standbys `_published` was made from

    def _job_store(self) -> Any:
        if self._store is None and self.settings.redis_url:
            from kuangchao.platform.jobs.store import JobStore

            self._store = JobStore.from_url(self.settings.redis_url, self.settings.redis_prefix)
        return self._store

    def hardware(self, node: str) -> dict[str, Any] | None:
        """This node's entry of `node_hardware_view` with the operator's overrides, read from the job store.

        The node view is read once and kept for VIEW_TTL_S: a job's ranks start in one
        burst, and one `ray.nodes()` plus two Redis reads per rank would grow start-up
        with the job's size."""
        store = self._job_store()
        now = time.monotonic()
        if self._view is None or now - self._view[0] > VIEW_TTL_S:
            self._view = (now, node_hardware_view(store))
        return self._view[1].get(node)

    def keep(self, node_ids: set[str], spec: JobSpec | None = None) -> None:
        """A spare on each of these nodes (the job's) and, for a job whose survivors keep
        their work, on `standby_spares` nodes it does not use (standby.py); the spares of
        any other node are retired (a node the job left, one no longer eligible)."""
        standby = spec.fault_tolerance.standby_spares if spec and spec.survivors_keep_work else 0
        wanted = set(node_ids) | (self._standby_choice(node_ids, standby, spec.parallel.gpus_per_rank)
                                  if spec and standby else set())
        for node_id in set(self.by_node) - wanted:
            kill_actor(self.by_node.pop(node_id))
            self._ready_refs.pop(node_id, None)
        for node_id in wanted - set(self.by_node):
            spare = self.by_node[node_id] = ray.remote(SpareActor).options(
                num_cpus=0, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
            self._ready(node_id, spare)  # asked now, so that warm_on knows without waiting
        before, self.own, self.standby = self.standby, set(node_ids), wanted - set(node_ids)
        if self.standby != before or len(self._standby_named) != len(self.standby):
            # Their names: read once for each new choice, and again while a read left one out.
            self._standby_named = {n.name: n.node_id for n in self.node_view()
                                   if n.node_id in self.standby}

    def tick(self, spec: JobSpec) -> None:
        """At each poll while the job runs: the job record's `spares` brought up to date
        (a spare that came up, or one behind a spare just used), and, every
        STANDBY_CHECK_S, the standby nodes chosen again (a node back or freed up since
        the last recovery may take one; one no longer eligible gives its spare up)."""
        now = time.monotonic()
        if (spec.fault_tolerance.standby_spares and self.by_node
                and now - self._checked >= STANDBY_CHECK_S):
            self._checked = now
            self.keep(self.own, spec)
        self.publish()

    def states(self) -> dict[str, str]:
        """Each spare's Ray node id -> `warm` (up), `warming` or `failed` (it did not
        start), asked without waiting."""
        refs = {node_id: self._ready(node_id, spare) for node_id, spare in self.by_node.items()}
        if not refs:
            return {}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=0)
        done, out = set(ready), {}
        for node_id, ref in refs.items():
            out[node_id] = "warming"
            if ref in done:
                try:
                    ray.get(ref, timeout=0)
                    out[node_id] = "warm"
                except ray.exceptions.RayError:
                    out[node_id] = "failed"
        return out

    def publish(self, entries: tuple[dict[str, Any], ...] | None = None) -> None:
        """Write the spares' states to the job record's `spares` when they changed
        (`entries`: these instead, () to clear them)."""
        store = self._job_store()
        if store is None or not self.job_id:
            return
        seen = None
        if entries is None:
            states = self.states()
            seen = (frozenset(states.items()), frozenset(self.standby))
            if seen == self._seen:  # nothing changed: no Redis read or write
                return
            names = {n.node_id: n.name for n in self.node_view()} if states else {}
            entries = spare_entries(states, self.standby, names)
        if entries != self._published:
            store.update(self.job_id, lambda j: None if j.spares == entries else (
                dataclasses.replace(j, spares=entries), None))
        self._published, self._seen = entries, seen

    def _standby_choice(self, used: set[str], count: int, gpus: int) -> set[str]:
        """standby.py's choice over the scheduler's published node view and quarantine."""
        store = self._job_store()
        try:
            view = self.node_view(strict=True)
            held = active(store.quarantine(), time.time()) if store is not None else {}
        except redis.RedisError:  # Redis away a moment: the standbys stay as they are
            return set(self.standby & set(self.by_node))
        types = {n.gpu_type for n in view if n.node_id in used}
        return standby_nodes(view, used, set(self.by_node), count, gpus,  # a warm one stays
                             types.pop() if len(types) == 1 else None,
                             {n.name for n in view if holds(held, n)})

    def node_view(self, strict: bool = False) -> list[NodeInfo]:
        """The scheduler's last published node view (draining marked); empty without one
        (or with Redis away, unless `strict`: then its error is raised)."""
        store = self._job_store()
        try:
            doc = store.info("nodes") if store is not None else None
        except redis.RedisError:
            if strict:
                raise
            return []
        return [NodeInfo.from_json(d) for d in (doc or {}).get("nodes", [])]

    def standby_names(self) -> list[str]:
        """The names of the nodes holding a standby spare (a relocation places there first)."""
        return names_of(self.node_view(), self.standby & set(self.by_node)) if self.standby else []

    def standby_nodes(self) -> dict[str, str]:
        """The nodes chosen for standby spares, name -> Ray node id (their peer-memory
        keepers start ahead, memory_plan.py)."""
        return dict(self._standby_named)

    def warm_on(self, node_id: str | None) -> Any | None:
        """The spare on `node_id` if it is up (started, nothing queued before a call), else None.

        Answers at once from the readiness asked when the spare started; a spare that
        failed to start counts as up here, and its first call says otherwise."""
        spare = self.by_node.get(node_id or "")
        if spare is None:
            return None
        ready, _ = ray.wait([self._ready(node_id, spare)], timeout=0)
        return spare if ready else None

    def _ready(self, node_id: str, spare: Any) -> Any:
        ref = self._ready_refs.get(node_id)
        if ref is None or ref[0] is not spare:
            ref = (spare, spare.__ray_ready__.remote())
            self._ready_refs[node_id] = ref
        return ref[1]

    def take(self, node_id: str, grant: Callable[[], dict[str, Any]], rank: dict[str, Any]) -> Any:
        """The spare on `node_id`, made the rank `rank` describes; None when there is none.

        `rank` holds job_id, rank, world_size, gpu_ids, node, heartbeat, authority and
        hardware (`node_hardware_view`); `grant` fetches the rank's fresh credentials.
        """
        spare = self.by_node.pop(node_id, None)
        self._ready_refs.pop(node_id, None)
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
        self.by_node, self.own, self.standby, self._ready_refs = {}, set(), set(), {}
        self._standby_named = {}
        with contextlib.suppress(Exception):  # bookkeeping: the job may be gone already
            self.publish(())


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
