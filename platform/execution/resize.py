"""The job controller's side of a live resize, planned or after a lost node.

A mixin of `JobController`. The scheduler asks for a resize on the job
record (grow into GPUs it reserved, shrink for a higher-priority job, or the
size a user asked for); a lost rank of an elastic job asks for one by
itself. Either way the controller:

1. starts the ranks that join (in the failed replica's placement group, or in
   a new one per added replica) while the others keep training;
2. publishes the next generation: who stays, at which rank, with what
   gradient accumulation, and where to meet (a rendezvous it hosts);
3. waits until every rank of it is in the new group and holds the state,
   then lets the leaving ranks go and gives their GPUs back.

The ranks do the rest themselves (`kuangchao.workers.elastic.resize`). Should any of
this fail, the job falls back to the requeue path: a restart from its newest
checkpoint at whatever size the scheduler can place.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group

from kuangchao.platform.cluster import quarantine
from kuangchao.platform.errors import Cancelled, FinishedDuringResize, GaveUp, KuangchaoError, WorkerLost
from kuangchao.platform.execution.bundles import pinned_nodes, rank_resources
from kuangchao.platform.execution.recovery import Failure, record_failure
from kuangchao.platform.execution.watch import kill_process
from kuangchao.platform.jobs.state import JobRecord, JobState, PlacedRank, resize, settle_resize
from kuangchao.platform.spec.elastic import Membership, plan_membership, replicas_left
from kuangchao.platform.spec.jobspec import JobSpec

GENERATION_READY_S = 300.0  # survivors finish their step, joiners take the state
JOINER_READY_S = 60.0  # a new rank's placement group and process; a grow is called off past it
LEAVE_WAIT_S = 30.0
POLL_S = 0.02


@dataclasses.dataclass
class _Joiner:
    """A replica that joins: its planned slots, and its placement group when it already has one."""

    slots: list[PlacedRank]
    pg: Any = None


class LiveResize:
    """Methods `JobController` runs to change a job's data-parallel size."""

    _cause = "requested"
    resize_by_restart: dict[str, Any] | None = None

    # -- triggers -------------------------------------------------------------
    def _resize_on_request(self, spec: JobSpec) -> None:
        """Act on the resize the scheduler asked for on the job record."""
        job = self.store.get(self.job_id)
        req = job.resize
        self.store.clear_resize(self.job_id)
        if req is None or job.state is not JobState.RUNNING:
            return
        if not self.live:
            # A train function that cannot resize in place checkpoints and yields;
            # the scheduler places it again at the size it can have.
            self.resize_by_restart = req
            self._open_entry(req, int(req["to"]), "restart")
            self.store.request_preempt(self.job_id, f"resize to {req['to']} replicas")
            return
        to = int(req["to"])
        m = plan_membership(self.world, self.spec_range, to)
        reserved = sorted((p for p in job.placement if p.rank >= self.world), key=lambda p: p.rank)
        joiners = [_Joiner(reserved[i:i + self.rpr]) for i in range(0, len(m.joining), self.rpr)]
        if len(reserved) < len(m.joining) or any(len(j.slots) < self.rpr for j in joiners):
            self._drop_request(f"resize to {to} replicas dropped: the scheduler reserved "
                               f"{len(reserved)} slot(s) for {len(m.joining)} new rank(s)")
            return
        self._begin(job, req, m, "live")
        try:
            self._run_generation(spec, m, joiners, dead=set(), planned=True)
        except FinishedDuringResize:
            pass  # the old group's results are in; the watch collects them

    def _resize_after_loss(self, failure: Failure, spec: JobSpec) -> bool:
        """An elastic job lost ranks: re-form the group around the survivors.

        Replicas whose node is still there (and not quarantined) get fresh
        ranks in their own placement group; replicas on a lost node are
        dropped. Returns False when the job cannot go on this way (fewer than
        `min_replicas` left, a second failure during a resize): the caller
        sends it back to the queue.
        """
        if failure.rank is None or failure.kind == "resize" or not self.pgs:
            return False
        job = self.store.get(self.job_id)
        by_rank = {p.rank: p for p in job.placement if p.rank < self.world}
        lost = self._lost_nodes({p.node_id for p in by_rank.values()})
        dead = {failure.rank} | {r for r, p in by_rank.items() if p.node_id in lost}
        if not record_failure(self.store, self.job_id, failure, spec.fault_tolerance.max_restarts,
                              self.settings.quarantine):
            raise GaveUp(failure.message)
        # After the failure is counted: it may just have put its node in quarantine.
        blocked = quarantine.active(self.store.quarantine(), time.time())
        rng, cur = self.spec_range, self.world // self.rpr
        hit = sorted({r // self.rpr for r in dead})
        replaceable = [i for i in hit if all(
            by_rank[r].node_id not in lost and by_rank[r].node not in blocked
            for r in rng.replica_ranks(i))]
        sizes = rng.sizes(upto=replicas_left(self.world, rng, dead) + len(replaceable))
        if not sizes:
            return False  # below min_replicas: the job, RECOVERING, goes back to the queue
        if failure.kind != "died" and self.watch is not None:
            kill_process(self.watch.hosts.get(failure.rank), by_rank[failure.rank].node_id)
        for r in dead:
            self._kill(self.workers[r])
        to = sizes[0]
        m = plan_membership(self.world, rng, to, drop_ranks=dead)
        joiners = [_Joiner([by_rank[r] for r in rng.replica_ranks(i)], self.pgs[i])
                   for i in replaceable][:len(m.joining) // self.rpr]
        job = self.store.get(self.job_id)
        self._begin(job, {"to": to, "from": cur, "cause": failure.kind,
                          "requested_at": failure.failed_at or time.time()}, m, "live")
        t0 = time.monotonic()
        try:
            self._run_generation(spec, m, joiners, dead=dead)
        except FinishedDuringResize:
            return False
        self.store.annotate_restart(self.job_id, {"path": "live", "placement_s":
                                                  round(time.monotonic() - t0, 3)})
        return True

    # -- the generation change -----------------------------------------------------
    def _run_generation(self, spec: JobSpec, m: Membership, joiners: list[_Joiner],
                        dead: set[int], planned: bool = False) -> None:
        """Move the job to membership `m`.

        Raises:
            WorkerLost: (kind "resize") when it fails once the ranks were told to
                move, or when the ranks to add cannot start after a loss.
            FinishedDuringResize: The job ended first; the old group is kept.
        A planned resize whose new ranks cannot start is called off instead:
        the job goes on at its size and the reserved GPUs are given back.
        """
        t0 = time.monotonic()
        old = (list(self.workers), list(self.refs), list(self.pgs), list(self.bundles),
               list(self.planned), list(self.infos))
        try:
            self._prepare(spec, m, joiners, old)
        except (KuangchaoError, ray.exceptions.RayError) as exc:
            if isinstance(exc, Cancelled) or not planned:
                self._fail_resize(exc, m)
            self._call_off(old, m, joiners, exc)
            return
        try:
            gen, leaving = self._go(spec, m, dead, old)
        except FinishedDuringResize:
            self._rollback_switch(old, m)
            raise
        except (KuangchaoError, ray.exceptions.RayError) as exc:
            self._fail_resize(exc, m)
        formed_s = time.monotonic() - t0
        self._release(leaving, old, m)
        self._commit(spec, m, joiners, gen, formed_s)

    def _fail_resize(self, exc: BaseException, m: Membership) -> None:
        if isinstance(exc, Cancelled):
            raise exc
        message = exc.message if isinstance(exc, KuangchaoError) else str(exc).splitlines()[0]
        raise WorkerLost(Failure("resize", f"live resize to {m.world_size} rank(s) failed: "
                                           f"{message}")) from None

    def _prepare(self, spec: JobSpec, m: Membership, joiners: list[_Joiner], old: tuple) -> None:
        """Start the joining ranks (and their placement groups) while the others train on."""
        workers, refs, pgs, bundles, planned, infos = old
        order = sorted(m.ranks, key=m.ranks.__getitem__)  # old ranks in their new order
        kept = [order[i] // self.rpr for i in range(0, len(order), self.rpr)]
        pinned = pinned_nodes()
        fresh = [j for j in joiners if j.pg is None]
        for j in fresh:
            j.pg = self._replica_pg(j.slots, [rank_resources(spec, p, pinned) for p in j.slots])
        self.pgs = [pgs[i] for i in kept] + [j.pg for j in joiners]
        slots = [s for j in joiners for s in j.slots]
        self.bundles = [bundles[r] for r in order] + [rank_resources(spec, s, pinned) for s in slots]
        self.planned = [planned[r] for r in order] + [s.gpus if s.node_id in pinned else None
                                                      for s in slots]
        self.world = m.world_size
        self.workers = [workers[r] for r in order]
        self.refs = [refs[r] for r in order]
        self.infos = [infos[r] for r in order]
        self._await_pgs([j.pg for j in fresh], JOINER_READY_S)
        self.workers += [self._spawn(rank, s.node, spec) for rank, s in zip(m.joining, slots,
                                                                            strict=True)]
        new_infos = self._wait_ready([self.workers[r].describe.remote() for r in m.joining],
                                     JOINER_READY_S, "new ranks")
        for s, info in zip(slots, new_infos, strict=True):
            if s.node_id and info["node_id"] != s.node_id:
                raise KuangchaoError(f"a new rank was planned on {s.node} but started on node "
                                     f"{info['node_id'][:12]}")
        self.infos += list(new_infos)

    def _go(self, spec: JobSpec, m: Membership, dead: set[int],
            old: tuple) -> tuple[Any, list[int]]:
        """Publish the generation, start the joiners' training, wait until the group is whole."""
        gen = self._publish(m.world_size, m.ranks, m.joining, self._cause, signal=True)
        doc = spec.model_dump(mode="json")
        for rank in m.joining:
            self.workers[rank].join.remote(gen.to_json(), rank, GENERATION_READY_S)
            self.refs.append(self.workers[rank].run.remote(doc))
        leaving = [r for r in range(len(old[0])) if r not in m.ranks and r not in dead]
        self._await_generation(gen)
        return gen, leaving

    def _call_off(self, old: tuple, m: Membership, joiners: list[_Joiner], exc: BaseException) -> None:
        """A grow whose new ranks could not start: keep training at the old size."""
        message = exc.message if isinstance(exc, KuangchaoError) else str(exc).splitlines()[0]
        new_pgs = [j.pg for j in joiners if j.pg is not None and j.pg not in old[2]]
        self._rollback_switch(old, m)
        for pg in new_pgs:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        world = self.world

        def back(j: JobRecord):
            if j.state is not JobState.RESIZING:
                return None
            log = j.resize_log[:-1] + ({**j.resize_log[-1], "called_off": message},) \
                if j.resize_log else ()
            return settle_resize(j, f"resize called off, staying at {world} rank(s): {message}",
                                 placement=tuple(p for p in j.placement if p.rank < world),
                                 resize=None, resize_log=log)
        self.store.update(self.job_id, back)
        self.store.wake_scheduler(self.job_id)

    def _await_generation(self, gen: Any) -> None:
        """Until every rank of `gen` is in and holds the state; fail on a rank's error.

        Leaving ranks are not watched here: they return once they read the
        generation, and `_release` waits for them.
        """
        keys = [gen.ready_key(r) for r in range(gen.world_size)]
        deadline = time.monotonic() + GENERATION_READY_S
        while not self.kv.check(keys):
            done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
            for ref in done:
                result = ray.get(ref)  # raises a rank's error, or its death
                if not (isinstance(result, dict) and result.get("left")):
                    raise FinishedDuringResize()
            if self.store.cancel_requested(self.job_id):
                raise Cancelled("cancelled")
            if time.monotonic() > deadline:
                raise KuangchaoError(f"generation {gen.gen} not formed within "
                                     f"{GENERATION_READY_S:.0f}s")
            time.sleep(POLL_S)

    def _rollback_switch(self, old: tuple, m: Membership) -> None:
        """Keep the old group's ranks: the job finished first, or the new ranks never came."""
        for rank in m.joining:
            if rank < len(self.workers):
                self._kill(self.workers[rank])
        self.workers, self.refs, self.pgs, self.bundles, self.planned, self.infos = (
            list(x) for x in old)
        self.world = len(self.workers)
        self.store.clear_rejoin(self.job_id)

    def _release(self, leaving: list[int], old: tuple, m: Membership) -> None:
        """Let the leaving ranks finish, stop them and free their replicas' GPUs."""
        workers, refs, pgs = old[0], old[1], old[2]
        if leaving:
            ray.wait([refs[r] for r in leaving], num_returns=len(leaving), timeout=LEAVE_WAIT_S)
        for r in range(len(workers)):
            if r not in m.ranks:
                self._kill(workers[r])
        keep = {id(pg) for pg in self.pgs}
        for pg in pgs:
            if id(pg) not in keep:
                try:
                    remove_placement_group(pg)
                except Exception:
                    pass

    # -- records ------------------------------------------------------------------
    def _entry(self, req: dict[str, Any], to: int, path: str) -> dict[str, Any]:
        """A resize's record; the first step at the new size closes it (`resize_s`)."""
        cur = self.world // self.rpr
        return {"from": cur, "to": to, "from_world_size": self.world,
                "to_world_size": to * self.rpr, "cause": str(req.get("cause") or "requested"),
                "path": path, "requested_at": req.get("requested_at") or time.time(),
                "for_job": req.get("for_job")}

    def _open_entry(self, req: dict[str, Any], to: int, path: str) -> None:
        entry = self._entry(req, to, path)
        self.store.update(self.job_id, lambda j: (dataclasses.replace(
            j, resize_log=(*j.resize_log, entry)), None))

    def _begin(self, job: JobRecord, req: dict[str, Any], m: Membership, path: str) -> None:
        """RESIZING, with the resize's entry opened (the first step at the new size closes it)."""
        cur = self.world // self.rpr
        self._cause = str(req.get("cause") or "requested")
        entry = self._entry(req, m.world_size // self.rpr, path)
        message = (f"resizing from {cur} to {entry['to']} replica(s) ({self._cause})"
                   if entry["to"] != cur else f"replacing {len(m.joining)} rank(s) in place")

        def begin(j: JobRecord):
            log = j.resize_log + ((entry,) if entry["to"] != cur else ())
            return resize(j, message, resize_log=log)
        self.store.update(self.job_id, begin)

    def _commit(self, spec: JobSpec, m: Membership, joiners: list[_Joiner], gen: Any,
                formed_s: float) -> None:
        infos, world = self.infos, m.world_size
        slots = [s for j in joiners for s in j.slots]
        by_new = {new: old for old, new in m.ranks.items()}

        def done(j: JobRecord):
            if j.state is not JobState.RESIZING:
                return None
            old = {p.rank: p for p in j.placement}
            placement = tuple(
                dataclasses.replace(old[by_new[r]] if r in by_new else slots[r - len(by_new)],
                                    rank=r, pid=infos[r]["pid"])
                for r in range(world))
            return settle_resize(j, f"generation {gen.gen}: {world} rank(s), {gen.replicas} "
                                    f"replica(s), {gen.accum} micro-batch(es) per step; formed in "
                                    f"{formed_s:.2f}s",
                                 placement=placement, world_size=world, replicas=gen.replicas,
                                 gpus=world * spec.parallel.gpus_per_rank, resize=None)
        self.store.update(self.job_id, done)
        if self.store.get(self.job_id).resize_log:
            self.store.annotate_resize(self.job_id, {"formed_s": round(formed_s, 3)})
        self.store.clear_rejoin(self.job_id)
        self.store.wake_scheduler(self.job_id)  # GPUs a shrink freed are someone's now
        self._watch_ranks(spec, infos)

    def _drop_request(self, message: str) -> None:
        self.store.update(self.job_id, lambda j: (dataclasses.replace(j, resize=None), {
            "type": "resize", "message": message}) if j.resize else None)

    # -- helpers --------------------------------------------------------------
    @staticmethod
    def _kill(actor: Any) -> None:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass

    @staticmethod
    def _lost_nodes(node_ids: set[str]) -> set[str]:
        from kuangchao.platform.execution.inplace import node_lost

        return {n for n in node_ids if node_lost(n)}
