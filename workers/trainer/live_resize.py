"""The built-in trainer's side of a live resize: rejoin, take the state, go on.

See `kuangchao.workers.elastic.generation` for the protocol. Here the trainer's own
state (model, optimizer, data position, gradient-norm history, RNG) is what
moves, and the sample record of an audited job (`data.record_samples`) is
kept true to what was trained.

It lives with the trainer, not in workers/elastic/, because it moves the
trainer's state (resume.py's `Position`, numerics.py's guard) over a
`TrainContext`: workers/elastic/ stays below the runtime and the trainer.
"""

from __future__ import annotations

from typing import Any

import torch

from kuangchao.platform.protocol.memory_copies import KeeperPlan
from kuangchao.workers.data.shares import Shares
from kuangchao.workers.elastic.generation import (
    await_generation,
    broadcast_state,
    gather_steps,
    join_generation,
    leave_group,
    mark_ready,
    state_source,
)
from kuangchao.workers.runtime.context import TrainContext
from kuangchao.workers.trainer.numerics import GradNormGuard, data_index
from kuangchao.workers.trainer.resume import Position, rng_state, set_rng_state

# How long a rank waits for the controller to publish the next generation after
# its group broke: the controller must notice the loss and start any new ranks.
REJOIN_WAIT_S = 180.0
# How long joining the new group may take: survivors still finishing their step.
JOIN_TIMEOUT_S = 300.0


def rejoin(ctx: TrainContext, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           guard: GradNormGuard, pos: Position) -> Position | None:
    """Leave the broken or resized group, join the next generation and hold the newest state.

    Returns:
        Where to continue, or None when this rank is not in the next generation.
    """
    joined = join_next(ctx, pos)
    if joined is None:
        return None
    return finish_rejoin(ctx, model, optimizer, guard, pos, joined)


def join_next(ctx: TrainContext, pos: Position) -> tuple[int, int, int, Any] | None:
    """Leave the old group and join the next generation, state untouched.

    Returns the old layout (data-parallel size, accumulation, first step, shares) for
    `finish_rejoin`, or None when this rank is not in the next generation. A
    user's own function re-runs between the two (workers/trainer/own.py): its
    model is built and wrapped again on the new group before the state moves.
    """
    old = (ctx.dp_size, ctx.accum_steps, ctx.generation_start, ctx.shares)
    with ctx.phase("rejoin"):
        ctx.checkpoint.settle(grace_s=min(30.0, ctx.spec.fault_tolerance.stop_grace_s))
        leave_group()
        store = ctx.store
        assert store is not None, "live resizing needs the job store"
        gen = await_generation(lambda: store.generation(ctx.job_id), ctx.generation, REJOIN_WAIT_S)
        new_rank = gen.ranks.get(ctx.rank)
        if new_rank is None:
            ctx.log(f"leaving the job at step {pos.step}: not in generation {gen.gen} "
                    f"({gen.world_size} rank(s), {gen.cause})")
            return None
        was = ctx.rank
        _, kv = join_generation(gen, new_rank, JOIN_TIMEOUT_S)
        ctx.regroup(new_rank, gen.world_size, gen.accum, gen.gen)
        if gen.keepers is not None:  # the keepers as the new membership has them
            ctx.keepers = gen.keepers
            if ctx.peer_memory is not None:
                ctx.peer_memory.replan(KeeperPlan.from_json(gen.keepers))
        ctx.generation_start = pos.step  # provisional; sync_state may move it on
        ctx.group_store = kv
    ctx.log(f"rank {was} is rank {new_rank} of {gen.world_size} in generation {gen.gen} "
            f"({gen.cause}) with {gen.accum} micro-batch(es) per step")
    return old


def finish_rejoin(ctx: TrainContext, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  guard: GradNormGuard, pos: Position | None, old: tuple[int, int, int, Any] | None,
                  scheduler: Any = None) -> Position:
    """Take the newest state in the new group (`pos`/`old` None: a rank that just joined),
    then tell the controller this rank is ready."""
    with ctx.phase("rejoin"):
        pos = sync_state(ctx, model, optimizer, guard, pos, old_layout=old, scheduler=scheduler)
        ctx.generation_start = pos.step
        ctx.checkpoint.prepare_group()  # while every rank is here (manager.prepare_group)
        mark_ready(ctx.group_store, ctx.rank)
    ctx.log(f"continuing at step {pos.step} in generation {ctx.generation}")
    ctx.expect_first_step("resize")
    return pos


def sync_state(ctx: TrainContext, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               guard: GradNormGuard, pos: Position | None,
               old_layout: tuple[int, int, int, Any] | None = None, scheduler: Any = None) -> Position:
    """Agree on the newest state in the group and send it to every rank that lacks it.

    Collective over the new group. `pos` is None on a rank without state (it
    just joined). When a survivor was one step behind (the old group broke
    while its all-reduce was still running elsewhere), it takes the newer state.
    `old_layout` (data-parallel size, accumulation, first step, shares) describes the
    generation that just ended, on survivors. A user's LR `scheduler` moves too.
    """
    steps = gather_steps(None if pos is None else pos.step)
    src, needed = state_source(steps)
    if needed:
        mine = None
        if ctx.rank == src:
            assert pos is not None
            mine = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "step": pos.step, "skipped": list(pos.skipped), "grad_norms": guard.state(),
                    "rng": rng_state(),
                    "scheduler": scheduler.state_dict() if scheduler is not None else None}
        got = broadcast_state(mine, src, ctx.device)
        if ctx.rank != src:
            model.load_state_dict(got["model"])
            optimizer.load_state_dict(got["optimizer"])
            guard.load_state(got["grad_norms"])
            set_rng_state(got["rng"])
            if scheduler is not None and got.get("scheduler") is not None:
                scheduler.load_state_dict(got["scheduler"])
            pos = Position(int(got["step"]), list(got["skipped"]))
    assert pos is not None
    if old_layout is not None and ctx.rank == src and pos.step - 1 >= old_layout[2]:
        # The last step was applied, so its all-reduce completed, so every rank of the
        # old layout had contributed its micro-batches, including a rank that died
        # before recording them: record the whole step.
        record_samples(ctx, pos.step - 1, pos, layout=old_layout[:2], shares=old_layout[3])
    optimizer.zero_grad(set_to_none=True)
    return pos


def record_samples(ctx: TrainContext, step: int, pos: Position,
                   layout: tuple[int, int] | None = None, shares: Any = None) -> None:
    """With `data.record_samples`, record the global samples trained on in `step`.

    Without `layout`, this rank's own micro-batches at the current size; with
    `layout` (data-parallel size, accumulation), every rank's of that layout, split
    by its `shares` (None: even).
    One hash field per (step, data-parallel size, data-parallel rank): writing
    the same fact twice leaves one record, while the same step trained at two
    sizes shows up as two.
    """
    if not ctx.spec.data.record_samples or ctx.store is None:
        return
    dp_size, accum = layout or (ctx.dp_size, ctx.accum_steps)
    ranks = range(dp_size) if layout else [ctx.dp_rank]
    shares = shares if layout else ctx.shares
    index = data_index(step, pos.skipped)
    if shares is None or shares.dp_size != dp_size:
        shares = Shares.even(dp_size, ctx.spec.parallel.micro_batch_size, accum)
    fields = {}
    for r in ranks:
        spans = shares.spans(index, r)
        fields[f"{step}/{dp_size}/{r}"] = ",".join(f"{s.start}:{s.stop}" for s in spans)
    try:
        ctx.store.record_samples(ctx.job_id, fields)
    except Exception as exc:  # an audit aid: training goes on
        ctx.log(f"could not record samples of step {step + 1}: {exc}", level="WARNING")


def forget_samples_from(ctx: TrainContext, step: int) -> None:
    """After a restore to `step`, the record's later steps were undone: drop them."""
    if ctx.spec.data.record_samples and ctx.store is not None and ctx.is_chief:
        try:
            ctx.store.forget_samples_from(ctx.job_id, step)
        except Exception as exc:
            ctx.log(f"could not trim the sample record: {exc}", level="WARNING")
