"""Peer-memory checkpoints, the rank's side: push this rank's state to keepers in
host memory, and restore from them (platform/protocol/memory_copies.py has the rules
and their reasons, platform/execution/keeper.py the keeper).

Push (`PeerMemory.push`, every `checkpoint.in_memory.interval_steps` steps): the
training thread copies the state to CPU (the same state a disk checkpoint saves for
this rank: model and optimizer shards as `read_states` gives them, DTensors as their
local shards, plus the rank state of workers/trainer/resume.py), into buffers reused
from push to push as the disk's async save does. Everything else runs on a background
thread: `torch.save` into memory, CRC-32, one `ray.put`, and a put to the keeper on
the rank's own node and on its `replicas` peers (`peers_for`). A push still running
on any rank when the next is due makes every rank skip that one (counted; the
trainer asks all ranks in one tiny all-reduce), so training never waits on a keeper
and the keepers always hold the same steps of every rank: a restore needs a step
that all ranks have, and ranks skipping on their own would leave none in common.
A keeper that stops answering holds a push up only until another keeper took the
copy and `STRAGGLER_S` more have passed (ray_keepers.py), so that one dead node's
keeper does not stop the copies to the others.
A copy over `max_mb_per_rank` is never sent: the rank warns once, stops pushing, and
the job relies on its disk checkpoints.

Restore (`restore`, from workers/trainer/resume.py): each rank lists its own copies
on every keeper of the job (a replacement may run on another node than the copies),
keeping those written under its layout; one all_gather shares what each found and
the disk's newest committed step, and every rank computes the same `choose_restore`.
Each then fetches that step and verifies it (size, CRC-32, layout, that it
deserializes and fits the model's shards), and one all_reduce agrees that every rank
has it, before any rank touches its model. Otherwise the ranks restore from disk.

How the state becomes bytes and goes back into the model is peer_state.py's. Ray is
imported only where a keeper is called, so that this module's logic is unit-tested
against in-memory keepers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kuangchao.platform.errors import CopyRefused
from kuangchao.platform.protocol.memory_copies import (
    CopyLayout,
    CopyMeta,
    KeeperPlan,
    checksum,
    choose_restore,
    layout_mismatch,
    mb,
    mismatch,
    peer_shortfall,
    peers_for,
)
from kuangchao.platform.spec.checkpoint import InMemorySection
from kuangchao.workers import fence
from kuangchao.workers.checkpoint.async_save import StagingBuffers, stage_to_cpu
from kuangchao.workers.checkpoint.peer_state import apply, check_fits, deserialize, local_tensors, serialize
from kuangchao.workers.checkpoint.ray_keepers import RayKeepers
from kuangchao.workers.checkpoint.state_reader import StateDictReader
from kuangchao.workers.errors import FencedError

Log = Callable[..., None]


# -- one rank's copies -------------------------------------------------------------------


class PeerMemory:
    """This rank's copies in its job's keepers.

    Memory in the rank: one host copy of its state, kept between pushes and
    overwritten by the next (the staging buffers), plus the serialized bytes while a
    push runs; the keepers hold the rest (platform/protocol/memory_copies.py).

    Args:
        plan: The job's keepers and each rank's node (from the controller).
        spec_hash: The job spec's hash; with the world size, the layout copies carry.
        section: `checkpoint.in_memory`.
        token: This rank's current capability token (renewed behind it).
        log: `ctx.log`-like: log(message, level=...).
        keepers: How keepers are called (RayKeepers; the unit tests pass in-memory ones).
    """

    def __init__(self, plan: KeeperPlan, rank: int, world_size: int, spec_hash: str,
                 section: InMemorySection, token: Callable[[], str | None], log: Log,
                 keepers: Any = None) -> None:
        self.plan, self.section, self.spec_hash = plan, section, spec_hash
        self.rank, self.world_size = rank, world_size
        self.keepers = keepers if keepers is not None else RayKeepers(plan)
        self._token, self._log = token, log
        self._reader, self._staging = StateDictReader(), StagingBuffers()
        self._thread: threading.Thread | None = None
        self._in_flight: int | None = None
        self.pushed = self.skipped = self.failed = 0
        self.disabled: str | None = None  # why this rank pushes no more
        self.last: dict[str, Any] = {}  # the last push: step, bytes, nodes, seconds
        self.last_blocked_s = 0.0
        self._said: set[str] = set()
        shortfall = peer_shortfall(plan.node_of, section.replicas)
        if shortfall:
            self._say("shortfall", shortfall, "INFO")

    @property
    def layout(self) -> CopyLayout:
        return CopyLayout(self.world_size, self.spec_hash)

    def regroup(self, rank: int, world_size: int) -> None:
        """Push as `rank` of `world_size` from now on (after a live resize)."""
        self.rank, self.world_size = rank, world_size

    def replan(self, plan: KeeperPlan) -> None:
        """Copy by the keepers and nodes of a new generation (ranks renumbered, a
        replica moved off a lost node): its own node and peers as they are now."""
        self.plan = plan
        if hasattr(self.keepers, "replan"):
            self.keepers.replan(plan)

    def _say(self, key: str, message: str, level: str = "WARNING") -> None:
        if key not in self._said:  # once per kind: a push every step must not flood the log
            self._said.add(key)
            self._log(message, level=level)

    def targets(self) -> list[str]:
        """The nodes whose keepers take this rank's copies: its own, then its peers."""
        own = self.plan.node_of.get(self.rank)
        if own is None:
            return []
        nodes = [own, *peers_for(self.rank, self.plan.node_of, self.section.replicas)]
        return [n for n in nodes if n in self.plan.keepers]

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def ready(self) -> bool:
        """Whether this rank could push now: no push in flight, and not disabled."""
        return self.disabled is None and not self.busy()

    def skip(self, step: int) -> None:
        """Count a due copy not made (this rank's or another's push still in flight)."""
        if self.disabled is not None:
            return
        self.skipped += 1
        why = (f"step {self._in_flight} is still being pushed" if self.busy()
               else "another rank's copy is still being pushed")
        self._say("skipped", f"peer-memory copy of step {step} skipped: {why} (counted; said "
                             "once)", "INFO")

    def push(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             rank_state: dict[str, Any]) -> bool:
        """Copy the state to CPU now and send it in the background; False when skipped."""
        if not self.ready():
            self.skip(step)
            return False
        t0 = time.perf_counter()
        model_sd, optim_sd = self._reader(model, optimizer)
        staged = self._staging.stage({"model": local_tensors(model_sd), "optim": local_tensors(optim_sd)})
        payload = {**staged, "rank_state": stage_to_cpu(rank_state), "step": step}
        self.last_blocked_s = time.perf_counter() - t0
        self._in_flight = step
        self._thread = threading.Thread(target=self._send, args=(step, payload), daemon=True,
                                        name=f"kc-peer-copy-{step}")
        self._thread.start()
        return True

    def _send(self, step: int, payload: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        try:
            fence.check("a peer-memory copy")
            data = serialize(payload)
            bound = self.section.max_bytes_per_rank
            if len(data) > bound:
                self._stop(f"rank {self.rank}'s peer-memory copy is {mb(len(data))}, over "
                           f"checkpoint.in_memory.max_mb_per_rank ({mb(bound)}): no copies are "
                           "pushed, and the job restores from its disk checkpoints; raise the bound "
                           "to keep them")
                return
            meta = CopyMeta(self.rank, step, len(data), checksum(data), self.layout).to_json()
            answers = self.keepers.put(self.targets(), self._token(), meta, data)
            kept = sorted(n for n, a in answers.items() if not isinstance(a, BaseException))
            for node, answer in answers.items():
                if isinstance(answer, CopyRefused) and answer.reason == "too_large":
                    self._stop(f"the keeper on {node} refused rank {self.rank}'s copy: {answer}")
                elif isinstance(answer, BaseException):
                    self._say(f"put:{node}:{type(answer).__name__}",
                              f"the keeper on {node} did not take rank {self.rank}'s copy of step "
                              f"{step}: {answer} (said once per keeper and kind)")
            if kept:
                self.pushed += 1
            else:
                self.failed += 1
            self.last = {"step": step, "bytes": len(data), "nodes": kept,
                         "push_s": time.perf_counter() - t0}
        except FencedError as exc:
            self._stop(f"no more peer-memory copies: {exc}")
        except Exception as exc:  # noqa: BLE001 -- a copy is best effort; training goes on
            self.failed += 1
            self._say(f"push:{type(exc).__name__}", f"peer-memory copy of step {step} failed: {exc}")

    def _stop(self, why: str) -> None:
        self.disabled = why
        self._say("disabled", why)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the push in flight; False if it still runs after `timeout`."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return not self.busy()

    def available(self) -> dict[int, list[str]]:
        """step -> the nodes holding this rank's copy of it under this rank's layout."""
        found: dict[int, list[str]] = {}
        answers = self.keepers.listing(sorted(self.plan.keepers), self._token(), self.rank)
        for node, answer in sorted(answers.items()):
            if isinstance(answer, BaseException):
                self._log(f"the keeper on {node} could not list rank {self.rank}'s copies: {answer}",
                          level="INFO")
                continue
            for doc in answer:
                meta = CopyMeta.from_json(doc)
                if meta.rank != self.rank:
                    continue
                problem = layout_mismatch(meta, self.layout)
                if problem is not None:
                    self._log(f"ignoring the copy on {node}: {problem}", level="INFO")
                    continue
                found.setdefault(meta.step, []).append(node)
        return found

    def fetch(self, step: int, nodes: list[str], model: torch.nn.Module | None = None,
              optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any] | None:
        """This rank's copy of `step`, verified (size, CRC-32, layout, the weights-only
        load and, given the model, that it fits its shards), from the first of `nodes`
        that has one that does (this rank's own node first); None, each reason logged."""
        own = self.plan.node_of.get(self.rank)
        for node in sorted(nodes, key=lambda n: n != own):
            try:
                answer = self.keepers.get(node, self._token(), self.rank, step)
                if answer is None:
                    raise LookupError("it holds no such copy (any more)")
                meta = CopyMeta.from_json(answer["meta"])
                problem = mismatch(meta, answer.get("data"), self.layout)
                if problem is None and (meta.rank, meta.step) != (self.rank, step):
                    problem = f"it answered rank {meta.rank}'s step {meta.step}"
                if problem is not None:
                    raise ValueError(problem)
                payload = deserialize(answer["data"])
                if model is not None and optimizer is not None:
                    check_fits(payload, model, optimizer)
                return {**payload, "node": node}
            except Exception as exc:  # noqa: BLE001 -- the next keeper, or the disk
                self._log(f"ignoring rank {self.rank}'s copy of step {step} on {node}: {exc}",
                          level="WARNING")
        return None


# -- the trainer's side -----------------------------------------------------------------


def of(ctx: Any) -> PeerMemory | None:
    """The rank's peer memory (made on first use and kept on `ctx.peer_memory`), or None
    when the spec has no `checkpoint.in_memory` or the controller named no keepers."""
    section = ctx.spec.checkpoint.in_memory
    if section is None or getattr(ctx, "keepers", None) is None:
        return None
    peers = ctx.peer_memory
    if peers is None:
        plan = ctx.keepers if isinstance(ctx.keepers, KeeperPlan) else KeeperPlan.from_json(ctx.keepers)
        holder = getattr(ctx.checkpoint, "holder", None)
        peers = PeerMemory(plan, ctx.rank, ctx.world_size, ctx.spec.spec_hash(), section,
                           lambda: holder.token if holder is not None else None, ctx.log)
        ctx.peer_memory = peers
    peers.regroup(ctx.rank, ctx.world_size)
    return peers


def _all_gather(obj: Any, world_size: int) -> list[Any]:
    if world_size == 1 or not dist.is_initialized():
        return [obj]
    from kuangchao.workers.collectives import permit

    out: list[Any] = [None] * world_size
    permit("all_gather")
    dist.all_gather_object(out, obj)
    return out


def _everyone(ok: bool, world_size: int) -> bool:
    if world_size == 1 or not dist.is_initialized():
        return ok
    from kuangchao.workers.collectives import permit

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    permit("all_reduce")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def restore(peers: PeerMemory, disk_step: int | None, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """Load the newest step every rank holds in peers' memory, if it is at least as new as
    `disk_step` (the disk's newest committed step). Collective: every rank calls it.

    Returns:
        {"step", "rank_state", "node", "restore_s"} once the model and optimizer hold the
        copy; None (nothing loaded on any rank) when the ranks go to disk.
    """
    t0 = time.perf_counter()
    found = peers.available()
    everyone = _all_gather((sorted(found), disk_step), peers.world_size)
    steps = {r: set(s) for r, (s, _) in enumerate(everyone)}
    disks = [d for _, d in everyone if d is not None]
    step = choose_restore(max(disks) if disks else None, steps, peers.world_size)
    if step is None:
        if found or disks:
            peers._log(f"no step in peers' memory that every rank has, at least as new as the disk's "
                       f"(step {max(disks) if disks else 'none'}); restoring from disk", level="INFO")
        return None
    payload = peers.fetch(step, found.get(step, []), model, optimizer)
    if not _everyone(payload is not None, peers.world_size):
        peers._log(f"step {step} in peers' memory did not verify on every rank; restoring from disk",
                   level="WARNING")
        return None
    assert payload is not None
    apply(payload, model, optimizer)
    return {"step": step, "rank_state": payload["rank_state"], "node": payload["node"],
            "restore_s": time.perf_counter() - t0}
