"""The built-in trainer's batches: each step's share of its block, prefetched.

A rank trains on its data-parallel share of each step's block of global samples
(`ctx.shares`, workers/data/shares.py; None: the even split). When a measured
re-balance changes the shares, the batches already prefetched for the old ones
are dropped and made again from the next step (`Feed.restart`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kuangchao.platform.spec.jobspec import JobSpec
from kuangchao.workers.data.sampling import BatchSource, Prefetcher
from kuangchao.workers.data.shares import Shares
from kuangchao.workers.runtime.context import TrainContext
from kuangchao.workers.trainer.numerics import data_index
from kuangchao.workers.trainer.resume import Position


def _batches(source: BatchSource, spec: JobSpec, ctx: TrainContext,
             pos: Position) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """This rank's micro-batches of each step, one list a step (its share of the block)."""
    shares = ctx.shares or even_shares(ctx)
    for step in range(pos.step, spec.training.steps):
        index = data_index(step, pos.skipped)
        yield [source.get(idx) for idx in shares.spans(index, ctx.dp_rank)]


class Feed:
    """The step batches, prefetched; made again from the next step when the shares change."""

    def __init__(self, source: BatchSource, ctx: TrainContext, pos: Position) -> None:
        self.source, self.ctx, self.pos = source, ctx, pos
        self.it: Prefetcher | None = None

    def restart(self) -> None:
        self.close()
        self.it = Prefetcher(_batches(self.source, self.ctx.spec, self.ctx, self.pos),
                             depth=max(1, self.ctx.spec.data.prefetch))

    def close(self) -> None:
        if self.it is not None:
            self.it.close()
            self.it = None

    def __enter__(self) -> Feed:
        self.restart()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __next__(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        assert self.it is not None
        return next(self.it)


def even_shares(ctx: TrainContext) -> Shares:
    return Shares.even(ctx.dp_size, ctx.spec.parallel.micro_batch_size, ctx.accum_steps)


def loss_weight(ctx: TrainContext) -> float:
    """This rank's loss weight: the plain mean over ranks is then the sample-weighted one."""
    return ctx.shares.weight(ctx.dp_rank) if ctx.shares is not None else 1.0
