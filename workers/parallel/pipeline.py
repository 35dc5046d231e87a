"""Model chunks and pipeline schedules for the built-in models.

A chunk is a run of whole blocks, plus the embeddings on the first chunk and
the final norm and head on the last. Its submodules keep the names they have
in the whole model (`tok_emb`, `blocks.3.attn.q_proj`, `lm_head`), so a
checkpoint written by any layout loads into any other. Every layout, the
single chunk of an unpipelined model included, runs the model through
`ModelChunk.forward`.

GPT ties its head to its token embedding. With a pipeline, the first chunk's
embedding and the last chunk's head are two copies of that one weight, on
different ranks; `TiedWeights` sums their gradients after backward, as
Megatron does, so both copies take the same update and stay equal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from kuangchao.workers.parallel.layout import chunk_layers

SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                    "interleaved_1f1b": "ScheduleInterleaved1F1B"}


class ModelChunk(nn.Module):
    """Blocks `layers` of a built-in model, with its ends when `first`/`last`.

    Args:
        model: A built-in GPT or Llama; its submodules are shared, not copied.
        layers: The blocks this chunk runs.
        first, last: Whether the chunk embeds the tokens / ends in the head.
        recompute: Recompute each block's activations in backward
            (activation checkpointing) instead of keeping them.
    """

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool,
                 recompute: bool = False) -> None:
        super().__init__()
        self.rotary = hasattr(model, "rope")
        self.first, self.last, self.recompute = first, last, recompute
        if first:
            self.tok_emb = model.tok_emb
            if not self.rotary:
                self.pos_emb = model.pos_emb
            self.drop = model.drop
        if self.rotary:
            self.rope = model.rope
        # A ModuleDict keyed by the layer index keeps the whole model's names.
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if last:
            self.norm = model.norm
            self.lm_head = model.lm_head

    # A slower GPU emulated on CPU (workers/parallel/emulation.py); set on pipeline stages.
    emulation: Any = None
    # With sequence parallelism, a later stage's input is one of this many sequence shards.
    seq_shards = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] (first chunk) or hidden states [B, T, D] in; hidden
        states or, on the last chunk, logits [B, T, vocab] out."""
        emu = self.emulation
        if emu is None:
            return self._run(x, None)
        clock = emu.clock()
        with emu.timed():  # the forward's CPU time, slept again as (1/s - 1) of it
            out = self._run(x, clock)
        return emu.close(out, clock)  # the backward's clock starts where its gradient arrives

    def _run(self, x: torch.Tensor, clock: Any) -> torch.Tensor:
        seq_len = x.size(1) if self.first else x.size(1) * self.seq_shards
        if self.first:
            h = self.tok_emb(x)
            if not self.rotary:
                h = h + self.pos_emb(torch.arange(seq_len, device=x.device))
            x = self.drop(h)
        if clock is not None:  # and stops (and sleeps) where it leaves the chunk's blocks
            x = self.emulation.open(x, clock)
        extra = self.rope(seq_len) if self.rotary else ()
        for block in self.blocks.values():
            if self.recompute and self.training:
                x = checkpoint(block, x, *extra, use_reentrant=False)
            else:
                x = block(x, *extra)
        if self.last:
            x = self.lm_head(self.norm(x))
        return x


IGNORE = -100  # a target the loss does not count (a chat prompt's tokens)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the counted targets, in fp32 whatever the
    autocast dtype. A micro-batch with no counted target (a long prompt) adds a zero
    loss, not NaN, which the numeric guard would take for a fault."""
    flat = targets.flatten()
    # Summed and divided by the count on the device: no host sync to test for the
    # all-masked case, which comes out 0 / 1.
    total = F.cross_entropy(logits.float().flatten(0, 1), flat, ignore_index=IGNORE, reduction="sum")
    return total / (flat != IGNORE).sum().clamp(min=1)


def build_chunks(model: nn.Module, n_chunks: int, indices: list[int], recompute: bool,
                 split: tuple[int, ...] | None = None) -> list[ModelChunk]:
    """The chunks with the given indices of `model` split into `n_chunks` (equal runs of
    layers, or `split[i]` layers for chunk i)."""
    n_layers = len(model.blocks)
    return [ModelChunk(model, chunk_layers(n_layers, n_chunks, i, split), first=i == 0,
                       last=i == n_chunks - 1, recompute=recompute) for i in indices]


def scaled_loss(factor: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`lm_loss` times `factor`: a replica's weight by sample count when replicas run
    different numbers of pipeline micro-batches (workers/data/shares.py)."""
    if factor == 1.0:
        return lm_loss

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, targets) * factor

    return loss


class ChunkSet(nn.Module):
    """Every chunk a rank holds, under the whole model's names: what it checkpoints."""

    def __init__(self, chunks: list[ModelChunk]) -> None:
        super().__init__()
        blocks: dict[str, nn.Module] = {}
        for chunk in chunks:
            for name in ("tok_emb", "pos_emb", "drop", "rope", "norm", "lm_head"):
                if name in chunk._modules:
                    self.add_module(name, chunk._modules[name])
            blocks.update(chunk.blocks.items())
        self.blocks = nn.ModuleDict(dict(sorted(blocks.items(), key=lambda kv: int(kv[0]))))


class TiedWeights:
    """Sums the gradient of GPT's tied embedding/head across the two stages holding it.

    Args:
        model: The whole model, before it was cut (to tell whether it ties).
        first_ranks, last_ranks: For every pipeline, the rank of its first and
            of its last stage, in the same order.
        rank: This process's rank.

    Every rank of the job must construct it (`new_group` is collective).
    """

    def __init__(self, model: nn.Module, first_ranks: list[int], last_ranks: list[int],
                 rank: int) -> None:
        self.group: dist.ProcessGroup | None = None
        self.tied = getattr(model, "lm_head", None) is not None and \
            model.lm_head.weight is getattr(getattr(model, "tok_emb", None), "weight", None)
        if not self.tied or first_ranks == last_ranks:
            self.tied = False
            return
        for a, b in zip(first_ranks, last_ranks, strict=True):
            pg = dist.new_group([a, b])
            if rank in (a, b):
                self.group = pg

    def weight(self, holder: nn.Module) -> torch.Tensor | None:
        """This rank's copy of the tied weight, if it holds one."""
        if not self.tied or self.group is None:
            return None
        for name in ("tok_emb", "lm_head"):
            module = getattr(holder, name, None)
            if module is not None:
                return module.weight
        return None

    def duplicate(self, holder: nn.Module) -> torch.Tensor | None:
        """The copy a gradient norm must skip: the head's, on the last stage."""
        if self.weight(holder) is None or getattr(holder, "tok_emb", None) is not None:
            return None
        return holder.lm_head.weight

    def sync(self, holder: nn.Module) -> None:
        w = self.weight(holder)
        if w is None or w.grad is None:
            return
        grad = w.grad.to_local() if hasattr(w.grad, "to_local") else w.grad
        dist.all_reduce(grad, group=self.group)


def make_schedule(kind: str, stages: list, n_microbatches: int,
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """The torch.distributed.pipelining schedule for `kind` over this rank's stages."""
    import torch.distributed.pipelining as pipelining

    cls = getattr(pipelining, SCHEDULE_CLASSES[kind])
    if kind == "interleaved_1f1b":
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
