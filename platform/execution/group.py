"""One job's ranks as Ray holds them: actors, placement groups, grants, spares.

`RayWorkerGroup` is the only part of the controller that calls Ray. It keeps
one `Member` per rank (its actor, bundle, planned GPUs, what it reported and
its running `run` call) in rank order, one placement group per data-parallel
replica, the warm spares and the rendezvous store the job's generations meet
at. Every Ray error leaves it as one of ours (`RankFailed`, `WorkerLost`,
`Cancelled`), so the controller and its unit tests never see Ray's types.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kuangchao.platform.errors import Cancelled, KuangchaoError, RankFailed, WorkerLost
from kuangchao.platform.execution.bundles import (
    first_line,
    joiner_pgs,
    pinned_nodes,
    rank_resources,
    replica_pg,
)
from kuangchao.platform.execution.grants import Credentials, worker_settings
from kuangchao.platform.execution.members import GroupSnapshot, Member, Outcome
from kuangchao.platform.execution.node_agents import NodeAgents, heartbeat_args
from kuangchao.platform.execution.reachability import NodeReach, alive_nodes, lost_among, node_lost
from kuangchao.platform.execution.reachability import probe as probe_node
from kuangchao.platform.execution.recovery import Failure
from kuangchao.platform.execution.spares import SparePool, kill_actor
from kuangchao.platform.execution.watch import RankHost, kill_process
from kuangchao.platform.jobs.state import PlacedRank
from kuangchao.platform.settings import Settings
from kuangchao.platform.spec.jobspec import JobSpec
from kuangchao.workers.errors import WorkerError
from kuangchao.workers.runtime.rank_actor import RankActor

PG_READY_TIMEOUT_S = 180.0
RENDEZVOUS_TIMEOUT_S = 300.0


def error_message(exc: BaseException) -> str:
    """The message of the error a worker raised, without Ray's wrapping."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, WorkerError | KuangchaoError):
        return cause.message
    if isinstance(exc, KuangchaoError):
        return exc.message
    if isinstance(exc, ray.exceptions.RayActorError):
        return f"a worker process died: {exc}"
    return f"{type(exc).__name__}: {exc}"


class RayWorkerGroup:
    """The actors and placement groups of one job.

    Args:
        job_id: The job.
        settings: Handed to each rank (with the job's own Redis user).
        credentials: Grants each rank its token.
        should_stop: True once the job is cancelled; every wait checks it.
        poll_s: How long one wait for the ranks lasts.
    """

    def __init__(self, job_id: str, settings: Settings, credentials: Credentials,
                 should_stop: Callable[[], bool], poll_s: float = 0.5) -> None:
        self.job_id, self.settings, self.credentials = job_id, settings, credentials
        self.should_stop, self.poll_s = should_stop, poll_s
        self.members: list[Member] = []
        self.pgs: list[Any] = []  # one per data-parallel replica
        self.rpr = 1  # ranks per replica
        self.spares = SparePool(settings, job_id)
        self.agents = NodeAgents(job_id, settings.redis_prefix)
        self.job_redis_url: str | None = None  # the job's own Redis user, for its agents
        self.kv: Any = None  # the rendezvous store of every generation
        self.fresh_grants: dict[int, dict[str, Any]] = {}
        self.spec: JobSpec | None = None
        # What every `run` carries: the job's peer-memory keepers (memory_plan.py), or None.
        self.keeper_plan: Callable[[], dict[str, Any] | None] = lambda: None
        self.keepers_ahead: Callable[[dict[str, str]], None] = lambda nodes: None  # and ahead

    # -- what the controller reads -------------------------------------------
    @property
    def world(self) -> int:
        return len(self.members)

    @property
    def infos(self) -> list[dict[str, Any]]:
        return [m.info for m in self.members]

    @property
    def placed(self) -> bool:
        """Whether placement groups hold the ranks (none before the start or after teardown)."""
        return bool(self.pgs)

    # -- start ---------------------------------------------------------------
    def start(self, placement: Sequence[PlacedRank], spec: JobSpec) -> list[dict[str, Any]]:
        """Reserve the planned bundles, start one actor per rank; returns what each reported."""
        self.spec, self.rpr = spec, spec.elastic_range.ranks_per_replica
        pinned = pinned_nodes()
        bundles = [rank_resources(spec, p, pinned) for p in placement]
        self.members = [Member(None, b, p.gpus if p.node_id in pinned else None)
                        for b, p in zip(bundles, placement, strict=True)]
        self.pgs = [replica_pg(self.job_id, list(placement[r:r + self.rpr]), bundles[r:r + self.rpr])
                    for r in range(0, len(placement), self.rpr)]
        self._await_pgs(self.pgs, PG_READY_TIMEOUT_S, {p.node_id for p in placement})
        self.fresh_grants = self._grants(list(range(len(placement))))
        self.job_redis_url = next((g.get("redis_url") for g in self.fresh_grants.values()),
                                  None) or self.settings.redis_url
        for rank, slot in enumerate(placement):
            self.members[rank].actor = self._spawn(rank, slot.node)
        # The rendezvous store is torch's: load torch while the ranks start, not before.
        importlib.import_module("torch.distributed")
        return self.describe(300.0)

    def _await_pgs(self, pgs: list[Any], timeout_s: float, nodes: set[str] | None = None) -> None:
        if not pgs:
            return
        try:
            # A planned node Ray declares dead meanwhile will never take its bundles.
            self._wait([pg.ready() for pg in pgs], timeout_s, "placement group",
                       lambda: bool(nodes) and bool(nodes - alive_nodes()))
        except (Cancelled, WorkerLost):
            raise
        except KuangchaoError as exc:
            # A node that vanished after the plan was made: place the job again.
            raise WorkerLost(Failure("placement", exc.message)) from None

    def _grants(self, ranks: list[int]) -> dict[int, dict[str, Any]]:
        return self.credentials.grants({r: tuple(self.members[r].planned or ()) for r in ranks})

    def _spawn(self, rank: int, node: str) -> Any:
        """Start the actor of one rank in its bundle of its replica's placement group."""
        # Granted in one batch at start; one at a time for replacements and new ranks
        # (a rank's earlier token may have been renewed, hence revoked, meanwhile).
        grant = self.fresh_grants.pop(rank, None) or self._grants([rank])[rank]
        m = self.members[rank]
        custom = {k: v for k, v in m.bundle.items() if k not in ("CPU", "GPU")}
        return ray.remote(RankActor).options(
            num_cpus=m.bundle["CPU"], num_gpus=m.bundle.get("GPU", 0), resources=custom,
            max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pgs[rank // self.rpr], placement_group_bundle_index=rank % self.rpr),
        ).remote(self.job_id, rank, self.world, worker_settings(self.settings, grant), m.planned,
                 node, heartbeat_args(self._spec()), grant,
                 self.credentials.authority, hardware=self.spares.hardware(node))

    def _spec(self) -> JobSpec:
        assert self.spec is not None, "start the group first"
        return self.spec

    def describe(self, timeout_s: float, ranks: Sequence[int] | None = None) -> list[dict[str, Any]]:
        """Ask these ranks (all by default) where they run; keeps and returns the answers."""
        ranks = list(range(self.world)) if ranks is None else list(ranks)
        infos = self._wait([self.members[r].actor.describe.remote() for r in ranks], timeout_s,
                           "workers" if len(ranks) == self.world else "new ranks")
        for r, info in zip(ranks, infos, strict=True):
            self.members[r].info = info
        return infos

    # -- the process group ---------------------------------------------------
    def rendezvous(self) -> tuple[str, int]:
        """Where every generation of this job meets (a store this process hosts)."""
        host = ray.util.get_node_ip_address()
        if self.kv is None:
            from torch.distributed import TCPStore

            self.kv = TCPStore(host, 0, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
        return host, int(self.kv.port)

    def formed(self, keys: list[str]) -> bool:
        """Whether every rank of a generation said it is in (its ready keys are set)."""
        return bool(self.kv.check(keys))

    def join(self, generation: dict[str, Any]) -> str:
        """Every rank joins `generation`; returns the backend they formed."""
        backends = self._wait(
            [m.actor.join.remote(generation, r, RENDEZVOUS_TIMEOUT_S)
             for r, m in enumerate(self.members)], RENDEZVOUS_TIMEOUT_S + 30, "process group")
        return backends[0]

    def run(self, doc: dict[str, Any], ranks: Sequence[int] | None = None,
            join: dict[str, Any] | None = None, join_timeout_s: float = RENDEZVOUS_TIMEOUT_S) -> None:
        """Start the train function on these ranks (all by default); joiners join first."""
        keepers = self.keeper_plan()  # every rank gets the plan, or none does
        for r in range(self.world) if ranks is None else ranks:
            m = self.members[r]
            if join is not None:
                m.actor.join.remote(join, r, join_timeout_s)
            m.ref = m.actor.run.remote(doc, keepers)

    def poll(self, timeout_s: float, skip: set[int] = frozenset()) -> list[Outcome]:
        """The ranks (not in `skip`) whose `run` ended within `timeout_s`; one is enough."""
        pending = {m.ref: r for r, m in enumerate(self.members) if r not in skip and m.ref is not None}
        if not pending:
            return []
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout_s)
        return [self._outcome(pending[ref], ref) for ref in ready]

    def finished(self) -> list[Outcome]:
        """Every rank whose `run` has ended, without waiting."""
        refs = {m.ref: r for r, m in enumerate(self.members) if m.ref is not None}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        return [self._outcome(refs[ref], ref) for ref in done]

    @staticmethod
    def _outcome(rank: int, ref: Any) -> Outcome:
        try:
            return Outcome(rank, value=ray.get(ref))
        except ray.exceptions.RayActorError as exc:
            return Outcome(rank, died=first_line(exc))
        except Exception as exc:
            return Outcome(rank, error=error_message(exc))

    def dead_ranks(self, timeout_s: float = 15.0) -> list[tuple[int, str]]:
        """Ranks whose actor is gone. A live rank busy in `run` does not answer and
        counts as alive; a dead one's readiness check fails within seconds."""
        probes = [m.actor.__ray_ready__.remote() for m in self.members]
        ready, _ = ray.wait(probes, num_returns=len(probes), timeout=timeout_s)
        dead = []
        for rank, ref in enumerate(probes):
            if ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    dead.append((rank, first_line(exc)))
        return dead

    # -- replacing a rank in place ---------------------------------------------
    def stop(self, rank: int, host: RankHost | None, node_id: str | None, hard: bool) -> None:
        """Kill a rank; `hard` SIGKILLs its process first (a hung or stopped one
        cannot answer Ray's polite exit)."""
        if hard:
            kill_process(host, node_id)
        kill_actor(self.members[rank].actor)

    def replace(self, rank: int, slot: PlacedRank | None) -> bool:
        """A new actor for `rank`: a warm spare on its node if there is one (True), else fresh."""
        spare = self._take_spare(rank, slot)
        self.members[rank].actor = spare or self._spawn(rank, slot.node if slot else "")
        return spare is not None

    def survivors_stopped(self, ranks: list[int], timeout_s: float) -> bool:
        """Whether these ranks' `run` calls all failed within `timeout_s` (their
        collectives broke on the lost peer) and none of them died or finished."""
        refs = [self.members[r].ref for r in ranks]
        ready, not_ready = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if not_ready:
            return False
        return all(self._outcome(r, ref).error is not None for r, ref in zip(ranks, refs,
                                                                             strict=True))

    def reset(self, ranks: list[int]) -> None:
        """Survivors leave the broken process group, keeping their imports and state."""
        try:
            ray.get([self.members[r].actor.reset.remote() for r in ranks], timeout=30)
        except ray.exceptions.RayError as exc:
            raise RankFailed(f"survivors could not leave the process group: {first_line(exc)}") \
                from None

    def start_spares(self, node_ids: set[str]) -> None:
        """Keep one warm process on every node the job uses (`spare_workers`), and standbys."""
        self.spares.keep(node_ids, self._spec())

    def _take_spare(self, rank: int, slot: PlacedRank | None) -> Any | None:
        """A warm spare on the failed rank's node, made that rank; None when there is none."""
        if slot is None:
            return None
        rank_doc = {"job_id": self.job_id, "rank": rank, "world_size": self.world,
                    "gpu_ids": self.members[rank].info.get("gpu_ids", []), "node": slot.node,
                    "heartbeat": heartbeat_args(self._spec()),
                    "authority": self.credentials.authority, "hardware": self.spares.hardware(slot.node)}
        return self.spares.take(slot.node_id, lambda: self._grants([rank])[rank], rank_doc)

    # -- live resize -----------------------------------------------------------
    def snapshot(self) -> GroupSnapshot:
        return GroupSnapshot(tuple(dataclasses.replace(m) for m in self.members), tuple(self.pgs))

    def restore(self, snap: GroupSnapshot) -> None:
        """Back to `snap`: the ranks started since are killed."""
        kept = {id(m.actor) for m in snap.members}
        for m in self.members:
            if id(m.actor) not in kept:
                kill_actor(m.actor)
        self.members, self.pgs = [dataclasses.replace(m) for m in snap.members], list(snap.pgs)

    def reshape(self, order: list[int], joiners: list[tuple[list[PlacedRank], Any]],
                spares: bool = False) -> int:
        """Keep the ranks `order` names, in that order, and add the joiners' replicas.

        Each joiner is a replica's slots and its placement group (None: make one).
        The new ranks start, and their start is awaited, while the others train on.
        With `spares`, a slot a failed rank held (`slot.rank` below the old world) is
        taken by its node's warm spare, on that rank's GPUs, where there is one.
        Returns how many new ranks are spares.
        """
        spec, was = self._spec(), [m.info for m in self.members]
        kept = [order[i] // self.rpr for i in range(0, len(order), self.rpr)]
        pinned = pinned_nodes()
        fresh = joiner_pgs(self.job_id, spec, joiners, pinned)
        self.pgs = [self.pgs[i] for i in kept] + [pg for _, pg in joiners]
        slots = [s for group, _ in joiners for s in group]
        self.keepers_ahead({s.node: s.node_id for s in slots if s.node_id})  # beside the ranks
        self.members = [self.members[r] for r in order] + [
            Member(None, rank_resources(spec, s, pinned), s.gpus if s.node_id in pinned else None)
            for s in slots]
        self._await_pgs(fresh, 60.0)
        first, taken = len(order), 0
        try:
            for rank, s in enumerate(slots, start=first):
                m, spare = self.members[rank], None
                if spares and s.rank < len(was):  # a failed rank's slot: its GPUs, its spare
                    m.info = dict(was[s.rank])
                    spare = self._take_spare(rank, s)
                elif (m.planned is not None or not m.bundle.get("GPU")) and s.node_id in self.spares.by_node:
                    m.info = {"gpu_ids": list(m.planned or ())}  # a standby's (warm or warming)
                    spare = self._take_spare(rank, s)
                taken += spare is not None
                m.actor = spare or self._spawn(rank, s.node)
        except ray.exceptions.RayError as exc:
            raise RankFailed(f"a new rank could not start: {first_line(exc)}") from None
        infos = self.describe(60.0, range(first, self.world))
        for s, info in zip(slots, infos, strict=True):
            if s.node_id and info["node_id"] != s.node_id:
                raise RankFailed(f"a new rank was planned on {s.node} but started on node "
                                 f"{info['node_id'][:12]}")
        return taken

    def release(self, snap: GroupSnapshot, leaving: list[int], wait_s: float) -> None:
        """Let the leaving ranks (of `snap`) finish, then stop every rank and free every
        placement group the new group does not hold."""
        if leaving:
            ray.wait([snap.members[r].ref for r in leaving], num_returns=len(leaving),
                     timeout=wait_s)
        now = {id(m.actor) for m in self.members}
        for m in snap.members:
            if id(m.actor) not in now:
                kill_actor(m.actor)
        self.drop_pgs([pg for pg in snap.pgs if all(pg is not p for p in self.pgs)])

    @staticmethod
    def drop_pgs(pgs: list[Any]) -> None:
        for pg in pgs:
            try:
                remove_placement_group(pg)
            except Exception:
                pass

    # -- nodes, waits, teardown ------------------------------------------------------
    def reach(self, node_id: str, redis: tuple[str, int]) -> NodeReach:
        """Whether node `node_id` answers Ray, and reaches Redis from there (its spare asks)."""
        return probe_node(node_id, redis, via=self.spares.warm_on(node_id))

    node_lost = staticmethod(node_lost)  # whether a node is gone (reachability.py)
    lost_among = staticmethod(lost_among)  # which of several nodes are gone, in one read

    def _wait(self, refs: list[Any], timeout_s: float, what: str,
              lost: Callable[[], bool] | None = None) -> list[Any]:
        """Wait for every ref, checking for a cancel (and with `lost`, a lost node) each poll."""
        deadline = time.monotonic() + timeout_s
        while True:
            _, not_ready = ray.wait(refs, num_returns=len(refs), timeout=self.poll_s)
            if not not_ready:
                break
            if self.should_stop():
                raise Cancelled("cancelled")
            if lost is not None and lost():
                raise RankFailed(f"a node planned for the {what} was lost before it was ready")
            if time.monotonic() > deadline:
                raise RankFailed(f"{what} not ready after {timeout_s:.0f}s; check `ray status` "
                                 "for missing nodes or resources")
        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as exc:
            raise WorkerLost(Failure("died", f"a worker died while the {what} was starting: "
                                             f"{first_line(exc)}")) from None
        except ray.exceptions.RayError as exc:
            raise RankFailed(error_message(exc)) from None

    def ensure_agents(self, placement: Sequence[PlacedRank]) -> None:
        """A node agent on each node of `placement` that has none (node_agents.py)."""
        self.agents.ensure(placement, self._spec(), self.job_redis_url)

    def teardown(self) -> None:
        self.agents.close()
        for m in self.members:
            kill_actor(m.actor)
        self.members = []
        self.spares.close()
        self.drop_pgs(self.pgs)
        self.pgs = []
        self.kv = None  # closes the rendezvous this process hosted
