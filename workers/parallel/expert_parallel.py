"""Expert parallelism: a mixture of experts' experts split over ranks, tokens moved by all_to_all.

`parallel.expert_parallel_size` (EP) ranks are carved out of the data-parallel
dimension, as Megatron and DeepSpeed do: the data-parallel index splits into
`dp = edp x ep`, row-major, so an EP group is `ep` consecutive data-parallel
indices and the "expert-data-parallel" (edp) group of a rank is the ranks, one
per EP group, that hold the same experts. In each MoE layer an EP rank holds
`n_experts / ep` experts (EP index j: experts j*n/ep .. (j+1)*n/ep - 1, under
their global names); attention, norms, router, embeddings and head stay whole.

What reduces where:

* routing counts: all-gathered over the whole data-parallel group (expert
  capacity is global: workers/models/router.py), once per layer and micro-batch;
* tokens: all_to_all over the EP group to their experts' ranks and back
  (`AllToAll`, whose backward is the reverse all_to_all);
* gradients: dense ones are averaged over the data-parallel group; an expert's
  over its edp group, summed and divided by dp (its holder already summed the
  gradients of the `ep` ranks whose tokens it served);
* the gradient norm: the experts' squares summed over the EP group as well.

It composes with tensor parallelism (each expert split as a SwiGLU MLP,
`expert_plan`), pipelines (each stage's layers, per micro-batch, in schedule
order) and ZeRO 0, 2 and 3 (FSDP2 shards experts over the edp group, the rest
over dp: workers/parallel/expert_wiring.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


def expert_plan(moe: nn.Module) -> dict[str, ColwiseParallel | RowwiseParallel]:
    """The tensor-parallel split of the experts a rank holds, by path from the block."""
    plan: dict[str, ColwiseParallel | RowwiseParallel] = {}
    for name in moe.experts:
        path = f"moe.experts.{name}"
        plan[f"{path}.gate_proj"] = ColwiseParallel()
        plan[f"{path}.up_proj"] = ColwiseParallel()
        plan[f"{path}.down_proj"] = RowwiseParallel()
    return plan


class AllToAll(torch.autograd.Function):
    """`all_to_all_single` with `send[i]` rows to and `recv[i]` rows from EP rank i; its
    backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def run_experts(experts: nn.ModuleDict, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows `x` sorted by expert, `counts[i]` for the i-th of `experts` by index; every expert
    runs, on no rows if it has none (a zero gradient, the same on every rank)."""
    order = sorted(experts, key=int)
    return torch.cat([experts[name](chunk)
                      for name, chunk in zip(order, x.split(counts), strict=True)])


class ExpertComm:
    """How one rank's MoE layers reach the other ranks (`MoELayer.comm`).

    Args:
        dp_group: The data-parallel group the routing counts are gathered over.
        dp_rank, dp_size: This rank's index in it, and its size.
        ep_group: The expert-parallel group (None when ep is 1).
        ep_size: Ranks the experts are split over.
    """

    def __init__(self, dp_group: dist.ProcessGroup | None, dp_rank: int, dp_size: int,
                 ep_group: dist.ProcessGroup | None, ep_size: int) -> None:
        self.dp_group, self._dp_rank, self._dp_size = dp_group, dp_rank, dp_size
        self.ep_group, self.ep_size = ep_group, ep_size
        self.follows_world = False

    @classmethod
    def single(cls) -> ExpertComm:
        """One process: the global micro-batch is its own, every expert is here."""
        return cls(None, 0, 1, None, 1)

    @classmethod
    def world(cls) -> ExpertComm:
        """Plain data parallelism: the data-parallel group is the default group, whatever
        it is at each forward (a live resize re-forms it under the same layers)."""
        comm = cls(None, 0, 1, None, 1)
        comm.follows_world = True
        return comm

    @property
    def dp_size(self) -> int:
        if self.follows_world:
            return dist.get_world_size() if dist.is_initialized() else 1
        return self._dp_size

    @property
    def dp_rank(self) -> int:
        if self.follows_world:
            return dist.get_rank() if dist.is_initialized() else 0
        return self._dp_rank

    def gather(self, row: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Every data-parallel rank's `row`, stacked in rank order, and this rank's index."""
        size = self.dp_size
        if size == 1:
            return row.unsqueeze(0), 0
        rows = [torch.empty_like(row) for _ in range(size)]
        dist.all_gather(rows, row, group=self.dp_group)
        return torch.stack(rows), self.dp_rank

    def run(self, experts: nn.ModuleDict, x: torch.Tensor, kept: torch.Tensor,
            me: int) -> torch.Tensor:
        """The experts' outputs for rows `x` (this rank's kept assignments, sorted by expert).

        `kept[r, e]`: how many of data-parallel rank r's assignments expert e takes.
        With EP, rows go to their experts' ranks, run there expert by expert, and come back.
        """
        if self.ep_size == 1:
            return run_experts(experts, x, kept[me].tolist())
        ep = self.ep_size
        first, j = me - me % ep, me % ep
        # [source EP rank, destination EP rank, the destination's local expert]
        per = kept[first:first + ep].view(ep, ep, -1)
        send, recv = per[j].sum(-1).tolist(), per[:, j].sum(-1).tolist()
        got = AllToAll.apply(x, send, recv, self.ep_group)
        counts = per[:, j]  # rows from each source, by local expert
        perm = _expert_major(counts).to(got.device)
        y = run_experts(experts, got.index_select(0, perm), counts.sum(0).tolist())
        back = y.index_select(0, torch.argsort(perm))
        return AllToAll.apply(back, recv, send, self.ep_group)


def _expert_major(counts: torch.Tensor) -> torch.Tensor:
    """The order that regroups rows received source by source (each source's rows by
    expert) into expert by expert (each expert's rows by source)."""
    flat = counts.flatten()
    starts = (flat.cumsum(0) - flat).view_as(counts).tolist()
    sizes = counts.tolist()
    parts = [torch.arange(starts[s][e], starts[s][e] + sizes[s][e])
             for e in range(counts.shape[1]) for s in range(counts.shape[0])]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
