"""The built-in trainer's balanced work on mixed GPU generations (`resources.balance: speed`).

Per process group (the first, and again after every regroup: a live resize, or
a restart onto other nodes), the ranks exchange their speeds once (one
all-reduce of a small tensor; workers/parallel/balance.py says what a speed is)
and derive:

- the pipeline's layers per stage (before the model is cut; `layer_split`);
- the data-parallel shares of each step's samples (`form`), which the batches,
  the loss weights and the sample record follow.

Then, in a group whose speeds differ, the speeds are measured (`after_step`):
over a few steps after the first of the group, each rank's compute time per
sample (CPU time plus emulation sleep on CPU, CUDA events on GPU) is
all-reduced, and if the shares it calls for differ from the current ones by
more than `REBALANCE_THRESHOLD`, the shares are re-balanced once. A pipeline's
measured stage speeds are reported, and its layers stay where they are: moving
layers between live stages is left to a restart.

Every change of shares is an event in the job's stream (`rebalanced`: old and new
shares, the speeds behind them, and why).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kuangchao.workers.collectives import permit
from kuangchao.workers.data.shares import Shares
from kuangchao.workers.parallel.balance import (
    dp_shares,
    measured_shares,
    own_speed,
    rank_speeds,
    share_cut,
    speeds_differ,
    split_applies,
    stage_speeds,
    stage_split,
    stage_times,
)
from kuangchao.workers.parallel.emulation import Emulation
from kuangchao.workers.parallel.layout import Layout
from kuangchao.workers.runtime.context import TrainContext

# The first step of a group is not measured (allocations, the DDP reducer's first
# pass, the pipeline's shape exchange); the next MEASURE_STEPS are.
MEASURE_SKIP, MEASURE_STEPS = 1, 3


@dataclass
class BalanceState:
    """What the trainer keeps between steps (on `ctx.balance`)."""

    formed_for: tuple[int, int] | None = None  # (generation, world size) of the shares
    speeds: list[float] = field(default_factory=list)
    steps: int = 0  # steps trained since the shares were formed
    seconds: float = 0.0
    samples: int = 0
    measured: bool = False
    last: Shares | None = None  # the shares of the previous group, for the event


def emulation_of(ctx: TrainContext) -> Emulation | None:
    """The slowdown this rank emulates (the worker refused it where CUDA is)."""
    speed = ctx.emulated_speed
    return Emulation(speed) if speed is not None and speed < 1 else None


def exchange_speeds(ctx: TrainContext) -> list[float]:
    """Every rank's speed, in rank order: one all-reduce of a [world, 2] tensor in which
    each rank fills its own row (an all-gather by sum, under the all-reduce every
    layout's token grants)."""
    mine = own_speed(ctx.gpu_type, ctx.emulated_speed)
    if ctx.world_size == 1 or not dist.is_initialized():
        return rank_speeds([mine])
    table = torch.zeros(ctx.world_size, 2, dtype=torch.float64)
    table[ctx.rank] = torch.tensor(mine, dtype=torch.float64)
    permit("all_reduce")
    with ctx.collective("all_reduce (speeds)"):
        dist.all_reduce(table)
    return rank_speeds([(float(e), float(c)) for e, c in table.tolist()])


def layer_split(ctx: TrainContext, whole: torch.nn.Module, speeds: list[float]) -> tuple[int, ...] | None:
    """Layers per pipeline stage in proportion to the stages' speeds; None: the even cut
    (equal speeds, `balance: even`, an interleaved schedule, or no pipeline)."""
    p = ctx.spec.parallel
    layout = Layout.of(p, ctx.world_size)
    if (ctx.spec.resources.balance != "speed" or not split_applies(p, layout.pp)
            or getattr(whole, "opaque", False)):
        return None
    stages = stage_speeds(speeds, layout)
    if len(set(stages)) == 1:
        return None
    split = stage_split(len(whole.blocks), stages)
    ctx.log(f"pipeline stages at speeds {_rounded(stages)} take {list(split)} layers",
            layer_split=list(split), stage_speeds=stages)
    return split


def form(ctx: TrainContext, engine: Any, speeds: list[float] | None = None) -> None:
    """This group's data-parallel shares, at the top of each generation; `speeds`: already
    exchanged in this group (before the model was cut). A rollback in the same group
    keeps the shares it had."""
    state = ctx.balance if isinstance(ctx.balance, BalanceState) else BalanceState()
    ctx.balance = state
    key = (ctx.generation, ctx.world_size)
    if state.formed_for == key:
        engine.set_shares(ctx.shares)
        return
    old = state.last
    speeds = speeds if speeds is not None else exchange_speeds(ctx)
    shares = dp_shares(speeds, engine.layout, ctx.spec.parallel, ctx.accum_steps,
                       ctx.spec.resources.balance)
    ctx.shares = state.last = shares
    engine.set_shares(shares)
    state.formed_for, state.speeds = key, speeds
    state.steps, state.seconds, state.samples, state.measured = 0, 0.0, 0, False
    if not shares.is_even or (old is not None and not old.is_even):
        _rebalanced(ctx, "speeds", old, shares, speeds=speeds)


def after_step(ctx: TrainContext, engine: Any) -> bool:
    """Measure this step's compute; after the measured steps, re-balance once.

    Every rank calls it after every step (it may run one collective, at the same
    step everywhere). Returns whether the shares changed: the batches prefetched
    for the old ones must be made again.
    """
    state = ctx.balance
    if (not isinstance(state, BalanceState) or state.measured or ctx.world_size == 1
            or ctx.spec.resources.balance != "speed" or not dist.is_initialized()):
        return False
    if not speeds_differ(state.speeds):
        # Equal GPUs split evenly, bit for bit: what they measure apart is noise (a busy
        # host, a passing straggler), and a share moved by it would cost the run its
        # reproducibility for no lasting gain. Every rank holds the same exchanged speeds.
        state.measured = True
        return False
    state.steps += 1
    if state.steps <= MEASURE_SKIP:
        return False
    engine.compute.settle()
    state.seconds += engine.compute.seconds
    state.samples += engine.compute.samples
    if state.steps < MEASURE_SKIP + MEASURE_STEPS:
        return False
    state.measured = True
    per_sample = torch.zeros(ctx.world_size, dtype=torch.float64)
    per_sample[ctx.rank] = state.seconds / state.samples if state.samples else 0.0
    permit("all_reduce")
    with ctx.collective("all_reduce (measured speeds)"):
        dist.all_reduce(per_sample)
    times = per_sample.tolist()
    layout: Layout = engine.layout
    stages = None
    if layout.pp > 1:  # a stage's speed: its layers per second (equal layers when unsplit)
        layers = engine.layer_split or (1,) * layout.pp
        stages = [n / t if t > 0 else 0.0 for n, t in zip(layers, stage_times(times, layout),
                                                          strict=True)]
        _report_stages(ctx, engine, stages)
    cut = share_cut(ctx.spec.parallel, layout)
    current = ctx.shares or Shares.even(layout.dp, ctx.spec.parallel.micro_batch_size, ctx.accum_steps)
    found = measured_shares(current, times, layout, cut) if cut and layout.dp > 1 else None
    if found is None:
        return False
    shares, replicas = found
    ctx.shares = state.last = shares
    engine.set_shares(shares)
    _rebalanced(ctx, "measured", current, shares, speeds=replicas, stage_speeds=stages)
    return True


def _report_stages(ctx: TrainContext, engine: Any, stages: list[float]) -> None:
    """Log the measured stage speeds and the split they would give (kept until a restart)."""
    if not ctx.is_chief or min(stages) <= 0:
        return
    split = engine.layer_split
    n_layers = sum(split) if split else ctx.spec.model.n_layers
    best = list(stage_split(n_layers, stages)) if n_layers and n_layers >= len(stages) else None
    ctx.log(f"measured pipeline stage speeds {_rounded(stages)} (best split {best}); layers per "
            f"stage stay {list(split) if split else 'even'}: layers move only at a restart",
            stage_speeds=stages, best_split=best)


def _rebalanced(ctx: TrainContext, cause: str, old: Shares | None, new: Shares,
                speeds: list[float], stage_speeds: list[float] | None = None) -> None:
    """Log the new shares and, from rank 0, add a `rebalanced` event to the job's stream."""
    if not ctx.is_chief:
        return
    why = {"speeds": "the group's speeds", "measured": "measured compute times"}[cause]
    message = (f"data-parallel shares {list(old.counts) if old else 'even'} -> {list(new.counts)} "
               f"samples per step, from {why} {_rounded(speeds)}")
    event = {"ts": time.time(), "type": "rebalanced", "cause": cause,
             "old": list(old.counts) if old else None, "new": list(new.counts),
             "speeds": speeds, "message": message}
    if stage_speeds is not None:
        event["stage_speeds"] = stage_speeds
    ctx.log(message, rebalanced=cause, shares=list(new.counts), speeds=speeds)
    if ctx.store is not None:
        try:
            ctx.store.add_event(ctx.job_id, event)
        except Exception as exc:  # bookkeeping; training goes on
            ctx.log(f"could not record the re-balance event: {exc}", level="WARNING")


def _rounded(xs: list[float]) -> list[float]:
    top = max(xs) if xs else 1.0
    return [round(x / top, 3) for x in xs] if top > 0 else list(xs)
