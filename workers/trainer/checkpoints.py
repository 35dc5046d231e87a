"""When and how the built-in trainer checkpoints: periodic saves in the background or
not, the synchronous final and preemption checkpoints, the log line of each
commit, and the rule that no background write outlives the train function.

Split from loop.py, which decides at which steps these run; what a checkpoint
holds (rank state, data position) is resume.py's, and writing it the checkpoint
manager's.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from kuangchao.platform.protocol.checkpoint import CheckpointInfo
from kuangchao.workers.checkpoint import peer_memory
from kuangchao.workers.checkpoint.async_save import PendingCheckpoint
from kuangchao.workers.errors import CheckpointError
from kuangchao.workers.runtime.context import TrainContext
from kuangchao.workers.trainer.job_model import manifest_model
from kuangchao.workers.trainer.numerics import GradNormGuard, data_position
from kuangchao.workers.trainer.resume import Position, rank_state

# A background checkpoint write still running when the train function fails gets
# at most this long, and at most half of `fault_tolerance.stop_grace_s`: the
# controller replaces a dead rank in place only if the survivors stop within it.
PENDING_GRACE_S = 30.0


def settles_checkpoints(fn: Callable[[TrainContext], dict[str, Any]]):
    """Make sure no background checkpoint write outlives the train function.

    On a normal return, the write in flight is waited for and its failure
    fails the run. When the function raises, its error wins: the write gets a
    bounded grace (a hung peer can leave it stuck in a collective), and a
    failure of it is only logged.
    """
    @functools.wraps(fn)
    def wrapper(ctx: TrainContext) -> dict[str, Any]:
        try:
            result = fn(ctx)
        except BaseException:
            grace = min(PENDING_GRACE_S, ctx.spec.fault_tolerance.stop_grace_s / 2)
            try:
                ctx.checkpoint.wait(timeout=grace)
            except CheckpointError as exc:
                ctx.log(f"abandoning a checkpoint write: {exc}", level="WARNING")
            raise
        ctx.checkpoint.wait()
        return result
    return wrapper


def save_step(ctx: TrainContext, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
          pos: Position, guard: GradNormGuard, *, sync: bool | None = None,
          ) -> CheckpointInfo | PendingCheckpoint:
    """Checkpoint `step`, in the background when `checkpoint.async_save` is on.

    The final checkpoint and one taken while a preemption is pending are
    written synchronously (after any write in flight): the caller hands the
    committed checkpoint on at once. `sync` overrides the choice.

    Args:
        pos, guard: The data position (skipped batches) and gradient-norm
            history, saved so that a restore continues the exact sequence.

    Returns:
        The committed checkpoint, or the pending one when written in the background.
    """
    spec = ctx.spec
    if sync is None:
        # preemption_requested() is a collective: fine, every rank reaches save_step at the same step.
        sync = (not spec.checkpoint.async_save or step >= spec.training.steps
                or ctx.preemption_requested())
    if not sync and getattr(ctx.checkpoint, "remote", None) is not None:
        # An object store that stopped answering holds the previous upload up (it
        # retries until its deadline); training goes on, and this checkpoint is skipped
        # rather than waited for. Agreed by every rank: they save together or not at all.
        previous = ctx.checkpoint.pending
        if ctx.any_rank(previous is not None and not previous.done(), "checkpoint in flight"):
            skip_event(ctx, step, previous)
            return previous  # type: ignore[return-value]
    state = rank_state(step, pos.skipped, guard)
    extra = {"parallel": spec.parallel.model_dump(),
             "data_position": data_position(step, pos.skipped),
             "model": manifest_model(spec)}  # what `kc checkpoint export --format hf` rebuilds
    with ctx.phase("checkpoint"):
        if sync:
            info = ctx.checkpoint.save(step, model, optimizer, rank_state=state, extra=extra)
        else:
            pending = ctx.checkpoint.save_async(step, model, optimizer, rank_state=state,
                                                extra=extra)
    if sync:
        if ctx.is_chief:
            ctx.log(f"checkpoint step {step} -> {info.path} ({info.bytes} bytes, training blocked "
                    f"{info.blocked_s:.2f}s)", step=step, blocked_s=info.blocked_s)
        return info
    if ctx.is_chief:
        ctx.log(f"checkpoint step {step}: training blocked {pending.blocked_s:.3f}s to stage it; "
                "writing in the background", step=step, blocked_s=pending.blocked_s)
        pending.add_done_callback(lambda p: _log_commit(ctx, p))
    return pending


def push_to_peers(ctx: TrainContext, step: int, model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer, pos: Position, guard: GradNormGuard) -> None:
    """Every `checkpoint.in_memory.interval_steps` steps, this rank's state to its keepers
    (workers/checkpoint/peer_memory.py): training waits for the CPU copy only. Inert
    without `checkpoint.in_memory`, or when the controller named no keepers."""
    section = ctx.spec.checkpoint.in_memory
    if section is None or ctx.keepers is None or step % section.interval_steps:
        return
    peers = peer_memory.of(ctx)
    if peers is None:
        return
    # Every rank pushes the same steps or none: a restore takes a step all ranks hold,
    # and ranks skipping on their own (a push in flight) could leave none in common.
    if ctx.any_rank(not peers.ready(), "peer-memory copy in flight"):
        peers.skip(step)
        return
    peers.push(step, model, optimizer, rank_state(step, pos.skipped, guard))


def skip_event(ctx: TrainContext, step: int, previous: PendingCheckpoint | None) -> None:
    """Say that the checkpoint of `step` was skipped because an upload is still running."""
    busy = previous.step if previous is not None else "?"
    message = (f"checkpoint step {step} skipped: step {busy} is still being uploaded to "
               f"{ctx.checkpoint.location} (the store is slow or not answering; the upload is "
               "retried until its deadline)")
    ctx.log(message, level="WARNING", step=step)
    if ctx.is_chief and ctx.store is not None:
        with contextlib.suppress(Exception):  # Redis away costs the event, never the step
            ctx.store.add_event(ctx.job_id, {"type": "checkpoint_skipped", "step": step,
                                             "message": message})


def _log_commit(ctx: TrainContext, pending: PendingCheckpoint) -> None:
    """Rank 0's log line once a background write ends (runs on the writer thread)."""
    try:
        info = pending.result()
    except CheckpointError as exc:
        ctx.log(f"{exc}; the next checkpoint call raises it", level="ERROR", step=pending.step)
        return
    ctx.log(f"checkpoint step {info.step} -> {info.path} ({info.bytes} bytes, written in "
            f"{info.write_s:.2f}s in the background)", step=info.step, write_s=info.write_s)
