"""Where the built-in trainer starts from: a fresh model, the newest checkpoint
that verifies, or (after a numeric fault) a rollback to it.

Every rank makes the same choice: they read the same checkpoint folder and
verify it the same way, and a rollback is triggered by a gradient norm all
ranks share.
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kuangchao.platform.protocol.checkpoint import step_of
from kuangchao.platform.version import __version__
from kuangchao.workers.checkpoint import peer_memory
from kuangchao.workers.errors import CheckpointError, NumericFault, TrainingError
from kuangchao.workers.runtime.context import TrainContext
from kuangchao.workers.trainer.numerics import GradNormGuard

# How long rank 0 waits for the controller's verdict on a numeric fault (it applies
# the ranks' reports between two polls, every half second).
VERDICT_WAIT_S = 30.0
VERDICT_POLL_S = 0.05


@dataclass
class Position:
    """The step to resume at and the batches never to train on."""

    step: int = 0
    skipped: list[int] = field(default_factory=list)


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
            "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def rank_state(step: int, skipped: list[int], guard: GradNormGuard) -> dict[str, Any]:
    """This rank's part of a checkpoint: RNG states and the data position."""
    return {"rng": rng_state(), "step": step, "skipped_batches": sorted(skipped),
            "grad_norms": guard.state()}


def restore_latest(ctx: TrainContext, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   guard: GradNormGuard) -> Position | None:
    """Load the newest checkpoint that verifies; broken newer ones are skipped with an event.
    With peer-memory copies, a step every rank holds there, at least as new as the
    newest on disk, wins (workers/checkpoint/peer_memory.py)."""
    ctx.checkpoint.wait()
    peers = peer_memory.of(ctx)
    if peers is not None:
        pos = _from_peers(ctx, peers, model, optimizer, guard)
        if pos is not None:
            return pos
    for path in reversed(ctx.checkpoint.list()):
        try:
            manifest = ctx.checkpoint.verify(path)
        except CheckpointError as exc:
            _event(ctx, {"type": "checkpoint_skipped", "path": str(path),
                         "message": f"skipped checkpoint {path.name}: {exc.message}"})
            continue
        state = ctx.checkpoint.load(path, model, optimizer)
        if "rng" in state:  # a converted checkpoint holds weights alone: the seed's RNG stays
            set_rng_state(state["rng"])
        guard.load_state(state.get("grad_norms"))
        pos = Position(int(manifest["step"]), list(state.get("skipped_batches") or []))
        ctx.log(f"restored checkpoint {path} at step {pos.step}{_restore_notes(manifest, ctx)}"
                + (f"; skipping batches {pos.skipped}" if pos.skipped else ""))
        return pos
    return None


def _from_peers(ctx: TrainContext, peers: peer_memory.PeerMemory, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer, guard: GradNormGuard) -> Position | None:
    """Restore from peers' memory (collective), or None: every rank goes to disk."""
    disk = [s for s in map(step_of, ctx.checkpoint.list()) if s is not None]
    got = peer_memory.restore(peers, max(disk) if disk else None, model, optimizer)
    if got is None:
        return None
    state = got["rank_state"]
    set_rng_state(state["rng"])
    guard.load_state(state.get("grad_norms"))
    pos = Position(int(got["step"]), list(state.get("skipped_batches") or []))
    ckpt = ctx.checkpoint  # for the restart record (TrainContext._note_first_step)
    ckpt.last_restored_step, ckpt.last_load_s, ckpt.last_load_end = pos.step, got["restore_s"], time.time()
    ctx.log(f"restored step {pos.step} from peer memory (the keeper on {got['node']}) in "
            f"{got['restore_s']:.2f}s" + (f"; skipping batches {pos.skipped}" if pos.skipped else ""))
    return pos


def fresh_start(ctx: TrainContext, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer) -> None:
    """Put the model and optimizer back to their state at step 0 (same seed, same init).

    `model` is this rank's share (workers/parallel/engine.py): the whole initial state is
    rebuilt, and each parameter takes its own slice of it (a pipeline stage
    its blocks, a tensor- or ZeRO-3-sharded parameter its shard), in place.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from kuangchao.workers.checkpoint.state_reader import saved_optimizer
    from kuangchao.workers.trainer.job_model import build_job_model

    seed_everything(ctx.spec.training.seed)
    initial = build_job_model(ctx.spec).state_dict()
    own = model.state_dict().keys()
    set_model_state_dict(model, {k: v for k, v in initial.items() if k in own},
                         options=StateDictOptions(full_state_dict=True, strict=True))
    optimizer.state.clear()
    saved_optimizer(optimizer).state.clear()


def roll_back(ctx: TrainContext, fault: NumericFault, model: torch.nn.Module,
              optimizer: torch.optim.Optimizer, guard: GradNormGuard,
              skipped: list[int]) -> Position:
    """Record a numeric fault, then restore the last good state and skip the batch.

    Raises:
        TrainingError: When the job has used up `fault_tolerance.max_restarts`.
    """
    message = f"numeric fault at {fault}; rolling back and skipping batch {fault.data_index}"
    if not _agree(_record(ctx, message), ctx):
        raise TrainingError(f"{message}; gave up after fault_tolerance.max_restarts restarts")
    t0 = time.perf_counter()
    pos = restore_latest(ctx, model, optimizer, guard)
    if pos is None:
        fresh_start(ctx, model, optimizer)
        guard.load_state([])
        pos = Position(0, [])
    pos.skipped = sorted({*pos.skipped, *skipped, fault.data_index})
    ctx.log(f"rolled back to step {pos.step} after {fault}; batches skipped from now on: "
            f"{pos.skipped}", level="WARNING")
    _resume_running(ctx, pos, time.perf_counter() - t0)
    return pos


def _record(ctx: TrainContext, message: str) -> bool:
    """Rank 0 reports the fault; the controller counts it as a restart or fails the
    job, and its verdict says whether to roll back (False: no restarts left)."""
    ctx.rollbacks += 1
    if ctx.store is None:
        return ctx.rollbacks <= ctx.spec.fault_tolerance.max_restarts
    if not ctx.is_chief:
        return True
    before = ctx.store.get(ctx.job_id)
    report_id = uuid.uuid4().hex
    ctx.store.post_report(ctx.job_id, {"kind": "numeric_fault", "id": report_id, "message": message})
    deadline = time.monotonic() + VERDICT_WAIT_S
    while time.monotonic() < deadline:
        answer = ctx.store.report_answer(ctx.job_id, report_id)
        if answer is not None:
            return bool(answer.get("roll_back"))
        time.sleep(VERDICT_POLL_S)
    # No controller answered (it may be restarting): judge from the record as read.
    ctx.log(f"no verdict on the numeric fault within {VERDICT_WAIT_S:.0f}s; deciding from "
            "the job's restart count", level="WARNING")
    return before.restarts < ctx.spec.fault_tolerance.max_restarts


def _agree(ok: bool, ctx: TrainContext) -> bool:
    """Every rank takes rank 0's decision."""
    if ctx.world_size == 1 or not dist.is_initialized():
        return ok
    flag = torch.tensor([1.0 if ok else 0.0])
    with ctx.phase("collective"):
        dist.broadcast(flag, src=0)
    return bool(flag.item())


def _resume_running(ctx: TrainContext, pos: Position, restore_s: float) -> None:
    ctx.expect_first_step()
    if not ctx.is_chief or ctx.store is None:
        return
    try:
        ctx.store.post_report(ctx.job_id, {
            "kind": "rolled_back",
            "reason": f"rolled back to step {pos.step}; skipping batches {pos.skipped}",
            "restart": {"path": "rollback", "restore_s": round(restore_s, 3), "resumed_step": pos.step}})
    except Exception as exc:  # bookkeeping; training goes on
        ctx.log(f"could not report the rollback: {exc}", level="WARNING")


def _event(ctx: TrainContext, event: dict[str, Any]) -> None:
    ctx.log(event["message"], level="WARNING")
    if ctx.is_chief and ctx.store is not None:
        try:
            ctx.store.add_event(ctx.job_id, event)
        except Exception:
            pass


def _restore_notes(manifest: dict[str, Any], ctx: TrainContext) -> str:
    """What differs between the restored checkpoint and this run, for the log."""
    notes = []
    if manifest.get("world_size", ctx.world_size) != ctx.world_size:
        notes.append(f"written by {manifest['world_size']} ranks, now {ctx.world_size}: "
                     "RNG states come from rank 0's file where a rank has none")
    version = manifest.get("platform_version")
    if version is not None and version != __version__:
        notes.append(f"written by kuangchao {version}, this is {__version__}")
    return f" ({'; '.join(notes)})" if notes else ""
