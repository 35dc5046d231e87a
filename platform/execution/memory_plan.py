"""The controller's side of peer-memory checkpoints (`checkpoint.in_memory`): the job's
keepers started on the nodes of its placement, the plan every rank's `run` carries,
their bytes reported, and their end with the job.

- **Start.** Before the ranks run, a keeper on every node of the placement
  (platform/execution/keeper.py, `start_keepers`: by name, so a requeued job's new
  controller finds the keepers its earlier run left, and starts the missing ones).
  A node whose keeper does not start is left out, with an event; with none at all
  the job runs on its disk checkpoints alone, and no rank gets a plan.
- **The plan.** Every `run` of the worker group (the first, after an in-place
  replacement, a live generation's joiners) carries `KeeperPlan(keepers, node_of)`:
  every live keeper of the job (those of an earlier run's nodes too: a replacement
  finds the copies kept on surviving nodes) and each rank's node in the membership
  that runs now. A node that joins the job later gets its keeper then, and so does
  a node back under its name as a new raylet (its keeper died with the old one).
- **Standing by.** A node that holds one of the job's standby spares (spares.py)
  gets its keeper ahead, started without waiting: a replica relocated there finds
  it up when the next generation's plan asks for it, where starting it then (a new
  Ray worker process) held the survivors about a second on a busy node. An idle
  keeper holds no copy; it ends with the job's others. So does every node new ranks
  are about to start on (the worker group's `keepers_ahead`, called as it reshapes):
  a replica relocated to a node with no standby, one just back from a drain, started
  its keeper only once its own process had imported everything, one after the
  other on a node whose CPUs the stalled survivors had left idle (the goodput run of
  2026-12-06 23:54: 3 s of imports, then 1 s of keeper start, then the generation).
- **Reported.** Every `STATS_EVERY_S` of the watch loop, what each keeper holds, as
  the gauge `kc_job_memory_checkpoint_bytes{job,node}` (a keeper that does not answer
  counts 0); a keeper that cannot be reached never fails the job.
- **End.** Once the job is terminal its keepers are killed (their copies with them);
  a job that goes back to the queue keeps them for its next run.

Ray is reached only through `KeeperOps` (loaded when used), so the controller stays
Ray-free and the unit tests pass in-memory ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kuangchao.platform.jobs.state import PlacedRank
from kuangchao.platform.observability import metrics
from kuangchao.platform.protocol.memory_copies import KeeperPlan, keeper_prefix
from kuangchao.platform.spec.jobspec import JobSpec

log = logging.getLogger(__name__)

STATS_EVERY_S = 10.0


@dataclass
class KeeperOps:
    """How keepers are reached: platform/execution/keeper.py's functions by default."""

    start: Callable[..., dict[str, str]]  # (job, {node: ray node id}, public key, max bytes[, wait])
    live: Callable[[str], list[str]]  # job -> names of its live keepers
    kill: Callable[[str], int]  # job -> how many were killed
    stats: Callable[[Mapping[str, str]], dict[str, dict[str, Any]]]  # node -> name

    @classmethod
    def ray(cls) -> KeeperOps:
        from kuangchao.platform.execution import keeper

        return cls(keeper.start_keepers, keeper.job_keepers, keeper.kill_keepers,
                   keeper.keeper_stats)


class JobKeepers:
    """One job's keepers, as its controller runs them.

    Args:
        store: The job store (events, the gauge, the placement).
        job_id: The job.
        group: The worker group: its `keeper_plan` is set to `plan`, so that every
            `run` it makes carries the plan, and its `keepers_ahead` to `stand_by`, for
            the nodes its new ranks start on; its `infos` say where each rank runs.
        credentials: Gives the token authority's public key (`public_key()`).
        ops: How keepers are reached (default: through Ray, loaded when first used).
        clock: For the stats' interval.
    """

    def __init__(self, store: Any, job_id: str, group: Any, credentials: Any,
                 ops: KeeperOps | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.job_id, self.group, self.credentials = store, job_id, group, credentials
        self._ops, self.clock = ops, clock
        self.section: Any = None  # checkpoint.in_memory while keepers serve this run
        self.keepers: dict[str, str] = {}  # node -> keeper name
        self.node_name: dict[str, str] = {}  # Ray node id -> kc.io/node name
        self.failed: set[str] = set()  # nodes whose keeper did not start (not asked again)
        self.started_on: dict[str, str] = {}  # node -> the Ray node id its keeper started on
        self.reported: set[str] = set()
        self.standing: dict[str, str] = {}  # node -> the Ray node id a keeper was asked to start on
        self._key: str | None = None
        self._next_stats = 0.0
        group.keeper_plan = self.plan
        group.keepers_ahead = self.stand_by

    @property
    def ops(self) -> KeeperOps:
        if self._ops is None:
            self._ops = KeeperOps.ray()
        return self._ops

    # -- start -------------------------------------------------------------------
    def begin(self, spec: JobSpec, placement: Sequence[PlacedRank]) -> None:
        """Start (or find) the keepers on the placement's nodes, before the ranks run."""
        section = spec.checkpoint.in_memory
        if section is None:
            return
        self._learn(placement)
        try:
            prefix = keeper_prefix(self.job_id)
            for name in self.ops.live(self.job_id):  # an earlier run's, on any node
                self.keepers.setdefault(name.removeprefix(prefix), name)
            self._ensure({p.node for p in placement}, section)
        except Exception as exc:  # noqa: BLE001 -- the job runs on its disk checkpoints
            self._event("peer_memory_off", f"peer-memory checkpoints are off for this run: "
                                           f"its keepers could not start ({exc}); the job "
                                           "restores from its disk checkpoints")
            return
        if not self.keepers:
            self._event("peer_memory_off", "peer-memory checkpoints are off for this run: no "
                                           "node's keeper started; the job restores from its "
                                           "disk checkpoints")
            return
        self.section = section
        world = len(placement)
        bound = 2 * section.max_mb_per_rank * (1 + section.replicas) * world
        self._event("peer_memory", f"peer-memory keepers on {', '.join(sorted(self.keepers))}: "
                                   f"each rank's state every {section.interval_steps} step(s), on "
                                   f"its node and {section.replicas} other(s); at most "
                                   f"{section.max_mb_per_rank} MB a copy, {bound} MB for the job",
                    nodes=sorted(self.keepers), max_mb_per_rank=section.max_mb_per_rank,
                    bound_mb=bound)

    def _learn(self, placement: Sequence[PlacedRank]) -> None:
        self.node_name.update({p.node_id: p.node for p in placement if p.node_id})

    def _ensure(self, nodes: set[str], section: Any) -> None:
        """Keepers on these nodes, where there is none yet (a failed node is not asked again)."""
        by_name = {node: node_id for node_id, node in self.node_name.items()}
        missing = {n: by_name[n] for n in sorted(nodes - set(self.keepers) - self.failed)
                   if n in by_name}
        if not missing:
            return
        if self._key is None:
            self._key = self.credentials.public_key()
        started = self.ops.start(self.job_id, missing, self._key,
                                 section.max_mb_per_rank * 1024 * 1024)
        self.keepers.update(started)
        self.started_on.update({n: missing[n] for n in started})
        lost = sorted(set(missing) - set(started))
        self.failed.update(lost)
        if lost:
            self._event("peer_memory_keeper_missing",
                        f"no peer-memory keeper on {', '.join(lost)} (it did not start): the "
                        "ranks there keep their copies on other nodes only", nodes=lost)

    def stand_by(self, nodes: Mapping[str, str]) -> None:
        """Ask for a keeper, without waiting, on each of these nodes (name -> Ray node
        id: those of the job's standby spares, or those new ranks are starting on) that
        has none yet; a node back as a new raylet is asked again."""
        if self.section is None:
            return
        for n, i in nodes.items():  # a node back as a new raylet: its keeper died with the old
            self.node_name.setdefault(i, n)
        self._forget_restarted(set(nodes.values()))
        new = {n: i for n, i in nodes.items()
               if n not in self.keepers and n not in self.failed and self.standing.get(n) != i}
        if not new:
            return
        self.standing.update(new)
        try:
            if self._key is None:
                self._key = self.credentials.public_key()
            self.ops.start(self.job_id, new, self._key, self.section.max_mb_per_rank * 1024 * 1024,
                           wait=False)
        except Exception as exc:  # noqa: BLE001 -- the plan starts it, waiting, if it must
            log.warning("job %s: no keeper started ahead on %s: %s", self.job_id,
                        ", ".join(sorted(new)), exc)
            return
        # Asked, not confirmed: a keeper that then fails is started again, waiting, by the plan.
        self._event("peer_memory_ahead", f"peer-memory keeper asked for ahead on "
                                         f"{', '.join(sorted(new))}, not waited for: ranks "
                                         "start there next, or a standby spare waits there",
                    nodes=sorted(new))

    # -- the plan ------------------------------------------------------------------
    def plan(self) -> dict[str, Any] | None:
        """What every rank's `run` carries now: the job's keepers and each rank's node in
        the group as it is (`KeeperPlan.to_json()`), or None without peer memory."""
        if self.section is None:
            return None
        try:
            self._learn(self.store.get(self.job_id).placement)  # a grow's reserved slots too
        except Exception:  # noqa: BLE001 -- Redis away: what was learnt serves
            pass
        node_of = {r: self.node_name[info.get("node_id", "")]
                   for r, info in enumerate(self.group.infos)
                   if info.get("node_id", "") in self.node_name}
        self._forget_restarted({info.get("node_id", "") for info in self.group.infos})
        try:
            self._ensure(set(node_of.values()), self.section)
        except Exception as exc:  # noqa: BLE001 -- the new node's ranks copy to the others
            log.warning("job %s: no keeper on the new nodes: %s", self.job_id, exc)
        return KeeperPlan(dict(self.keepers), node_of).to_json()

    def _forget_restarted(self, node_ids: set[str]) -> None:
        """Forget the keeper of a node that came back as a new raylet (a drained or
        killed node returns under its name with a new Ray node id): it died with the
        old raylet, so `_ensure` starts another for the ranks placed there now."""
        for node_id in node_ids:
            node = self.node_name.get(node_id)
            if node is not None and self.started_on.get(node, node_id) != node_id:
                self.keepers.pop(node, None)
                self.failed.discard(node)
                del self.started_on[node]

    # -- reported ------------------------------------------------------------------
    def tick(self, standby: Mapping[str, str] | None = None) -> None:
        """From the watch loop: keepers ahead on the `standby` nodes (name -> Ray node
        id), and the keepers' bytes into the gauge, every STATS_EVERY_S."""
        if standby:
            self.stand_by(standby)
        if self.section is None or self.clock() < self._next_stats:
            return
        self._next_stats = self.clock() + STATS_EVERY_S
        try:
            answers = self.ops.stats(dict(self.keepers))
            self._gauge({n: float(answers.get(n, {}).get("bytes", 0)) for n in self.keepers})
        except Exception as exc:  # noqa: BLE001 -- a metric never costs the job
            log.warning("job %s: keeper stats not read: %s", self.job_id, exc)

    def _gauge(self, values: Mapping[str, float]) -> None:
        held = self.store.metric_fields(self.job_id)
        rec = self.store.recorder(self.job_id)
        for node, value in values.items():
            labels = {"job": self.job_id, "node": node}
            rec.set(metrics.MEMORY_CHECKPOINT_BYTES, value,
                    held.get(metrics.series_field(metrics.MEMORY_CHECKPOINT_BYTES, labels), 0.0),
                    **labels)
        self.reported.update(values)

    # -- end -----------------------------------------------------------------------
    def end(self) -> None:
        """Once the job is terminal, kill its keepers (all Ray knows, any run's); a job
        back in the queue keeps them for its next run."""
        try:
            job = self.store.get(self.job_id)
            if not job.state.is_terminal or not (job.spec.get("checkpoint") or {}).get("in_memory"):
                return
            killed = self.ops.kill(self.job_id)
            self._gauge(dict.fromkeys(self.reported, 0.0))
            log.info("job %s: %d peer-memory keeper(s) killed", self.job_id, killed)
        except Exception as exc:  # noqa: BLE001 -- the scheduler's sweep ends what is left
            log.warning("job %s: keepers not killed now: %s", self.job_id, exc)
        self.section, self.keepers = None, {}

    def _event(self, kind: str, message: str, **fields: Any) -> None:
        log.info("job %s: %s", self.job_id, message)
        try:
            self.store.add_event(self.job_id, {"type": kind, "message": message, **fields})
        except Exception:  # noqa: BLE001 -- bookkeeping
            pass
