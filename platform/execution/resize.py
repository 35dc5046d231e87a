"""The job controller's side of a live resize, planned or after a lost node.

`ResizeExecutor` works over the job's worker group. The scheduler asks for a resize on the job
record (grow into GPUs it reserved, shrink for a higher-priority job, or the
size a user asked for); a lost rank of an elastic job asks for one by
itself. Either way the controller:

1. starts the ranks that join (in the failed replica's placement group, or in
   a new one per added replica) while the others keep training;
2. publishes the next generation: who stays, at which rank, with what
   gradient accumulation, and where to meet (a rendezvous it hosts);
3. waits until every rank of it is in the new group and holds the state,
   then lets the leaving ranks go and gives their GPUs back.

The ranks do the rest themselves (`kuangchao.workers.trainer.live_resize`). Should any of
this fail, the job falls back to the requeue path: a restart from its newest
checkpoint at whatever size the scheduler can place.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from kuangchao.platform.errors import Cancelled, FinishedDuringResize, KuangchaoError, WorkerLost
from kuangchao.platform.execution import relocation
from kuangchao.platform.execution.failure_policy import FailureDecision
from kuangchao.platform.execution.recovery import Failure
from kuangchao.platform.jobs.state import (
    JobRecord,
    JobState,
    PlacedRank,
    resize,
    settle_resize,
    start,
)
from kuangchao.platform.spec.elastic import Membership, plan_membership
from kuangchao.platform.spec.jobspec import JobSpec

GENERATION_READY_S = 300.0  # survivors finish their step, joiners take the state
LEAVE_WAIT_S = 30.0
POLL_S = 0.02

Joiner = tuple[list[PlacedRank], Any]  # a joining replica's slots, and its placement group if any


class ResizeExecutor:
    """Changes one job's data-parallel size over its worker group.

    Args:
        store: The job store.
        job_id: The job.
        group: The worker group.
        formation: Publishes generations and re-arms the heartbeat watch.
        live: Whether the job resizes in place (else a resize is a checkpoint and a restart).
    """

    def __init__(self, store: Any, job_id: str, group: Any, formation: Any, live: bool) -> None:
        self.store, self.job_id, self.group, self.formation = store, job_id, group, formation
        self.live = live
        self.cause = "requested"
        self.by_restart: dict[str, Any] | None = None  # a resize that became a restart
        self.relocate_wait_s = relocation.RELOCATE_WAIT_S

    # -- triggers -------------------------------------------------------------
    def on_request(self, spec: JobSpec) -> None:
        """Act on the resize the scheduler asked for on the job record."""
        job = self.store.get(self.job_id)
        req = job.resize
        self.store.clear_resize(self.job_id)
        if req is None or job.state is not JobState.RUNNING:
            return
        to = int(req["to"])
        if not self.live:
            # A train function that cannot resize in place checkpoints and yields;
            # the scheduler places it again at the size it can have.
            self.by_restart = req
            self._open_entry(req, to, "restart")
            self.store.request_preempt(self.job_id, f"resize to {to} replicas")
            return
        rng = spec.elastic_range
        rpr, world = rng.ranks_per_replica, self.group.world
        m = plan_membership(world, rng, to)
        reserved = sorted((p for p in job.placement if p.rank >= world), key=lambda p: p.rank)
        joiners: list[Joiner] = [(reserved[i:i + rpr], None)
                                 for i in range(0, len(m.joining), rpr)]
        if len(reserved) < len(m.joining) or any(len(slots) < rpr for slots, _ in joiners):
            self._drop_request(f"resize to {to} replicas dropped: the scheduler reserved "
                               f"{len(reserved)} slot(s) for {len(m.joining)} new rank(s)")
            return
        self._begin(req, m, spec)
        try:
            self._run_generation(spec, m, joiners, dead=set(), planned=True)
        except FinishedDuringResize:
            pass  # the old group's results are in; the watch collects them

    def shrink_off(self, spec: JobSpec, m: Membership, cause: str) -> bool:
        """A planned shrink to `m` with no one joining: the ranks it leaves out (a drained
        node's, platform/execution/drain.py) go at their next step, the others train on.

        Returns whether the group now runs at `m`: False when the job finished first
        (the old group's results are in) or the shrink was called off.
        """
        rpr = spec.elastic_range.ranks_per_replica
        self._begin({"to": m.world_size // rpr, "from": self.group.world // rpr, "cause": cause,
                     "requested_at": time.time()}, m, spec)
        try:
            self._run_generation(spec, m, [], dead=set(), planned=True)
        except FinishedDuringResize:
            return False
        return self.group.world == m.world_size

    def move_off(self, spec: JobSpec, m: Membership, replicas: tuple[int, ...],
                 nodes: list[str], cause: str) -> bool:
        """A planned move at the same size (off a draining node): the scheduler places
        `replicas` elsewhere, their new ranks start while every rank trains on, and the
        ranks `m` leaves out go at their next step as the new ones take the state.

        Returns whether the group now runs at `m`: False when the scheduler had no
        room, the job finished first, or the move was called off.
        """
        rng = spec.elastic_range
        joiners = self._placed_elsewhere(replicas, nodes, rng.ranks_per_replica, planned=True)
        if joiners is None:
            return False
        cur = self.group.world // rng.ranks_per_replica
        self._begin({"to": cur, "from": cur, "cause": cause, "requested_at": time.time()}, m, spec,
                    moved=len(replicas) * rng.ranks_per_replica)
        try:
            formed = self._run_generation(spec, m, joiners, dead=set(), planned=True)
        except FinishedDuringResize:
            return False
        return formed is not None and self.group.world == m.world_size

    def after_loss(self, failure: Failure, decision: FailureDecision, spec: JobSpec) -> bool:
        """A job whose survivors keep their work lost ranks: re-form the group around them.

        Replicas in `decision.refill` get new ranks in their own placement group
        (a warm spare on the node with `spare_workers`, else a fresh actor); those
        in `decision.relocate` (their node lost) on nodes the scheduler places them
        on (relocation.py); the others are dropped (an elastic job shrinks). A refill
        at the same size keeps the job RECOVERING until the new generation formed.
        Returns False when the job finished meanwhile, or when the scheduler found no
        room for a lost replica (the caller sends it back to the queue).
        """
        assert decision.membership is not None and failure.rank is not None
        rng = spec.elastic_range
        job = self.store.get(self.job_id)
        by_rank = {p.rank: p for p in job.placement if p.rank < self.group.world}
        watch = self.formation.watch
        for r in decision.dead:
            self.group.stop(r, watch.hosts.get(r) if watch and r == failure.rank else None,
                            by_rank[r].node_id, hard=r == failure.rank and failure.kind != "died")
        m = decision.membership
        joiners: list[Joiner] = [([by_rank[r] for r in rng.replica_ranks(i)], self.group.pgs[i])
                                 for i in decision.refill]
        if decision.relocate:
            lost = sorted({by_rank[r].node for i in decision.relocate
                           for r in rng.replica_ranks(i)})
            moved = self._placed_elsewhere(decision.relocate, lost, rng.ranks_per_replica)
            if moved is None:
                return False
            joiners += moved
        cur = self.group.world // rng.ranks_per_replica
        self._begin({"to": m.world_size // rng.ranks_per_replica, "from": cur,
                     "cause": failure.kind, "requested_at": failure.failed_at or time.time()},
                    m, spec)
        t0 = time.monotonic()
        spares = bool(spec.fault_tolerance.spare_workers and joiners)
        try:
            formed = self._run_generation(spec, m, joiners, dead=set(decision.dead), spares=spares)
        except FinishedDuringResize:
            return False
        gen, taken = formed or (None, 0)
        # The survivors' first step in `gen` closes it (`survivor_stall_s`, reports.py).
        self.store.annotate_restart(self.job_id, {
            "path": "live", "placement_s": round(time.monotonic() - t0, 3), "generation": gen,
            "refilled": len(m.joining), "spare": taken > 0 if spares else None,
            "relocated": len(decision.relocate) * rng.ranks_per_replica or None})
        return True

    def _placed_elsewhere(self, replicas: tuple[int, ...], nodes: list[str], rpr: int,
                          planned: bool = False) -> list[Joiner] | None:
        """`replicas` (on `nodes`, lost or draining) as joiners on the slots the scheduler
        placed them on (relocation.py), each in a new placement group; None, said on the
        job and the request withdrawn, when it placed none."""
        answer = relocation.ask(self.store, self.job_id, list(replicas), nodes,
                                self.relocate_wait_s, planned=planned,
                                prefer=self.group.spares.standby_names())
        slots = sorted(answer.slots, key=lambda p: p.rank)
        if not slots or len(slots) != len(replicas) * rpr:
            relocation.withdraw(self.store, self.job_id)
            then = ("the job checkpoints and moves at the next poll" if planned
                    else "the job goes back to the queue")
            self.store.add_event(self.job_id, {
                "type": "relocation_failed", "nodes": nodes,
                "message": f"the replica(s) on {', '.join(nodes)} could not move live "
                           f"({answer.why_not or 'a partial answer'}): {then}"})
            return None
        return [(slots[i:i + rpr], None) for i in range(0, len(slots), rpr)]

    # -- the generation change -----------------------------------------------------
    def _run_generation(self, spec: JobSpec, m: Membership, joiners: list[Joiner],
                        dead: set[int], planned: bool = False,
                        spares: bool = False) -> tuple[int, int] | None:
        """Move the job to membership `m`; returns the generation and how many joiners
        were warm spares (`spares`: refill a failed rank with its node's spare), or None
        when a planned resize was called off.

        Raises:
            WorkerLost: (kind "resize") when it fails once the ranks were told to
                move, or when the ranks to add cannot start after a loss.
            FinishedDuringResize: The job ended first; the old group is kept.
        A planned resize whose new ranks cannot start is called off instead:
        the job goes on at its size and the reserved GPUs are given back.
        """
        t0 = time.monotonic()
        old = self.group.snapshot()
        order = sorted(m.ranks, key=m.ranks.__getitem__)  # old ranks in their new order
        try:
            taken = self.group.reshape(order, joiners, spares=spares)
        except KuangchaoError as exc:
            if isinstance(exc, Cancelled) or not planned:
                self._fail_resize(exc, m)
            self._call_off(old, exc)
            return None
        try:
            gen = self.formation.publish(m.ranks, m.joining, self.cause, signal=True)
            self.group.run(spec.model_dump(mode="json"), m.joining, join=gen.to_json(),
                           join_timeout_s=GENERATION_READY_S)
            self._await_generation(gen)
        except FinishedDuringResize:
            self._back_to(old)
            raise
        except KuangchaoError as exc:
            self._fail_resize(exc, m)
        formed_s = time.monotonic() - t0
        leaving = [r for r in range(len(old.members)) if r not in m.ranks and r not in dead]
        self.group.release(old, leaving, LEAVE_WAIT_S)
        self._commit(spec, m, [s for slots, _ in joiners for s in slots], gen, formed_s)
        return gen.gen, int(taken or 0)

    @staticmethod
    def _fail_resize(exc: KuangchaoError, m: Membership) -> None:
        if isinstance(exc, Cancelled):
            raise exc
        raise WorkerLost(Failure("resize", f"live resize to {m.world_size} rank(s) failed: "
                                           f"{exc.message}")) from None

    def _await_generation(self, gen: Any) -> None:
        """Until every rank of `gen` is in and holds the state; fail on a rank's error.

        Leaving ranks are not watched here: they return once they read the
        generation, and the release waits for them.
        """
        keys = [gen.ready_key(r) for r in range(gen.world_size)]
        deadline = time.monotonic() + GENERATION_READY_S
        while not self.group.formed(keys):
            for outcome in self.group.finished():
                if outcome.died is not None or outcome.error is not None:
                    raise KuangchaoError(outcome.error or f"rank {outcome.rank} died: "
                                                          f"{outcome.died}")
                if not (isinstance(outcome.value, dict) and outcome.value.get("left")):
                    raise FinishedDuringResize()
            if self.store.cancel_requested(self.job_id):
                raise Cancelled("cancelled")
            if time.monotonic() > deadline:
                raise KuangchaoError(f"generation {gen.gen} not formed within "
                                     f"{GENERATION_READY_S:.0f}s")
            time.sleep(POLL_S)

    def _back_to(self, old: Any) -> None:
        """Keep the old group's ranks: the job finished first, or the new ranks never came."""
        self.group.restore(old)
        self.store.clear_rejoin(self.job_id)

    def _call_off(self, old: Any, exc: KuangchaoError) -> None:
        """A grow whose new ranks could not start: keep training at the old size."""
        new_pgs = [pg for pg in self.group.pgs if all(pg is not p for p in old.pgs)]
        self._back_to(old)
        self.group.drop_pgs(new_pgs)
        world, message = self.group.world, exc.message

        def back(j: JobRecord):
            if j.state is not JobState.RESIZING:
                return None
            log = j.resize_log[:-1] + ({**j.resize_log[-1], "called_off": message},) \
                if j.resize_log else ()
            return settle_resize(j, f"resize called off, staying at {world} rank(s): {message}",
                                 placement=tuple(p for p in j.placement if p.rank < world),
                                 resize=None, resize_log=log, relocate=None)
        self.store.update(self.job_id, back)
        self.store.wake_scheduler(self.job_id)

    # -- records ------------------------------------------------------------------
    def _entry(self, req: dict[str, Any], to: int, rpr: int, path: str) -> dict[str, Any]:
        """A resize's record; the first step at the new size closes it (`resize_s`)."""
        world = self.group.world
        return {"from": world // rpr, "to": to, "from_world_size": world,
                "to_world_size": to * rpr, "cause": str(req.get("cause") or "requested"),
                "path": path, "requested_at": req.get("requested_at") or time.time(),
                "for_job": req.get("for_job")}

    def _open_entry(self, req: dict[str, Any], to: int, path: str) -> None:
        entry = self._entry(req, to, self._rpr(), path)
        self.store.update(self.job_id, lambda j: (dataclasses.replace(
            j, resize_log=(*j.resize_log, entry)), None))

    def _rpr(self) -> int:
        spec = self.formation.spec
        return spec.elastic_range.ranks_per_replica if spec else 1

    def _begin(self, req: dict[str, Any], m: Membership, spec: JobSpec, moved: int = 0) -> None:
        """RESIZING, with the resize's entry opened (the first step at the new size closes it).
        A planned move (`moved` ranks to other nodes) is RESIZING at the same size."""
        rpr = spec.elastic_range.ranks_per_replica
        cur = self.group.world // rpr
        self.cause = str(req.get("cause") or "requested")
        entry = self._entry(req, m.world_size // rpr, rpr, "live")
        if entry["to"] == cur and not moved:
            return  # a refill at the same size: nothing resizes, the job stays RECOVERING
        if moved:
            entry["moved"] = moved
        message = (f"moving {moved} rank(s) to other nodes at {cur} replica(s) ({self.cause})"
                   if moved else f"resizing from {cur} to {entry['to']} replica(s) ({self.cause})")
        self.store.update(self.job_id, lambda j: resize(j, message,
                                                        resize_log=(*j.resize_log, entry)))

    def _commit(self, spec: JobSpec, m: Membership, slots: list[PlacedRank], gen: Any,
                formed_s: float) -> None:
        infos, world = self.group.infos, m.world_size
        by_new = {new: old for old, new in m.ranks.items()}

        def done(j: JobRecord):
            if j.state not in (JobState.RESIZING, JobState.RECOVERING):
                return None
            old = {p.rank: p for p in j.placement}
            placement = tuple(
                dataclasses.replace(old[by_new[r]] if r in by_new else slots[r - len(by_new)],
                                    rank=r, pid=infos[r]["pid"])
                for r in range(world))
            # A refill at the same size never left RECOVERING: the job runs again.
            settle, kept = ((settle_resize, "") if j.state is JobState.RESIZING else
                            (start, f"; {len(m.joining)} rank(s) refilled live, "
                                    f"{len(by_new)} survivor(s) kept their work"))
            return settle(j, f"generation {gen.gen}: {world} rank(s), {gen.replicas} "
                             f"replica(s), {gen.accum} micro-batch(es) per step; formed in "
                             f"{formed_s:.2f}s{kept}",
                          placement=placement, world_size=world, replicas=gen.replicas,
                          gpus=world * spec.parallel.gpus_per_rank, resize=None, relocate=None)
        resizing = self.store.get(self.job_id).state is JobState.RESIZING  # not a refill
        self.store.update(self.job_id, done)
        if resizing and self.store.get(self.job_id).resize_log:
            self.store.annotate_resize(self.job_id, {"formed_s": round(formed_s, 3)})
        self.store.clear_rejoin(self.job_id)
        self.store.wake_scheduler(self.job_id)  # GPUs a shrink freed are someone's now
        placement = self.store.get(self.job_id).placement
        self.group.ensure_agents(placement)  # on nodes it grew to
        # Spares where the job runs now (a move or a resize); after a refill the controller does it.
        if resizing and spec.fault_tolerance.spare_workers:
            self.group.start_spares({p.node_id for p in placement})
        self.formation.watch_ranks(infos)

    def _drop_request(self, message: str) -> None:
        self.store.update(self.job_id, lambda j: (dataclasses.replace(j, resize=None), {
            "type": "resize", "message": message}) if j.resize else None)
