"""DDP communication hooks: gradient compression and the hierarchical all-reduce.

Each hook receives one gradient bucket (a flat tensor) and returns a future
of the averaged bucket, as DDP expects. They are registered by
`workers/parallel/engine.py` from `parallel.grad_compression` and
`parallel.hierarchical_allreduce`; at most one hook per model.

* timed: the default average all-reduce, with its flight time recorded;
* fp16/bf16: the bucket is cast down, all-reduced, and cast back: half the
  bytes on the wire, at the cost of the low bits of each gradient. (PyTorch's
  own bf16 hook refuses to run without NCCL, so both are written here.)
* PowerSGD: PyTorch's low-rank hook, which keeps an error-feedback state.
* hierarchical: reduce-scatter inside each node, all-reduce of each shard
  across nodes (rank i of every node together), all-gather inside the node.
  Only 1/k of the bucket crosses the slow inter-node link from each of a
  node's k ranks, instead of the whole bucket through a flat ring.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kuangchao.workers.parallel.comm_clock import CommClock


def _timed(clock: CommClock | None, what: str, group: str, fut: torch.futures.Future,
           finish: Callable[[torch.futures.Future], torch.Tensor]) -> torch.futures.Future:
    seq = clock.begin(what, group) if clock is not None else None

    def done(f: torch.futures.Future) -> torch.Tensor:
        if clock is not None and seq is not None:
            clock.end(seq)
        return finish(f)
    return fut.then(done)


def timed_allreduce_hook(clock: CommClock):
    """A DDP comm hook: the default average all-reduce, with its flight time recorded."""
    # No annotations: DDP checks them at run time, and this module's are strings.
    def hook(group, bucket):  # noqa: ANN001, ANN202
        pg = group if group is not None else dist.group.WORLD
        tensor = bucket.buffer().div_(dist.get_world_size(pg))
        seq = clock.begin(f"all_reduce (DDP bucket {bucket.index()})", "world")
        fut = dist.all_reduce(tensor, group=pg, async_op=True).get_future()

        def done(f: torch.futures.Future) -> torch.Tensor:
            clock.end(seq)
            return f.value()[0]
        return fut.then(done)
    return hook


def compress_hook(dtype: torch.dtype, clock: CommClock | None = None):
    """All-reduce each bucket in `dtype` (fp16 or bf16), then restore its own dtype."""
    # No annotations on the hook itself: DDP inspects them at run time.
    def hook(group, bucket):  # noqa: ANN001, ANN202
        pg = group if group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        low = buffer.to(dtype).div_(dist.get_world_size(pg))
        fut = dist.all_reduce(low, group=pg, async_op=True).get_future()

        def finish(f: torch.futures.Future) -> torch.Tensor:
            buffer.copy_(f.value()[0])
            return buffer
        return _timed(clock, f"all_reduce {dtype} (DDP bucket {bucket.index()})", "dp", fut, finish)
    return hook


def powersgd(process_group: dist.ProcessGroup | None, rank: int) -> tuple[Any, Callable]:
    """PyTorch's PowerSGD hook and its state.

    The first 2 steps all-reduce exactly, while DDP settles its buckets.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    state = ps.PowerSGDState(process_group=process_group, matrix_approximation_rank=rank,
                             start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
    return state, ps.powerSGD_hook


class Hierarchy:
    """The process groups of a two-level all-reduce over one data-parallel group.

    Args:
        groups: The data-parallel ranks by node, every node with the same count
            (`workers.layout.node_groups`).
        rank: This process's global rank.

    Every rank of the job must construct every Hierarchy (`dist.new_group` is
    collective over the world), in the same order.
    """

    def __init__(self, groups: list[list[int]], rank: int) -> None:
        self.local_size = len(groups[0])
        self.nodes = len(groups)
        self.intra: dist.ProcessGroup | None = None
        self.inter: dist.ProcessGroup | None = None
        for g in groups:
            pg = dist.new_group(g)
            if rank in g:
                self.intra, self.local_index = pg, g.index(rank)
        for i in range(self.local_size):
            members = [g[i] for g in groups]
            pg = dist.new_group(members)
            if rank in members:
                self.inter = pg

    def hook(self, clock: CommClock | None = None):
        """A DDP comm hook averaging each bucket over all nodes' ranks.

        The three steps run one after another on DDP's hook thread: each
        depends on the previous one's result, and chaining collectives from
        completion callbacks would let ranks issue them in different orders.
        """
        size = self.local_size * self.nodes

        def hook(group, bucket):  # noqa: ANN001, ANN202
            buffer = bucket.buffer()
            n = buffer.numel()
            pad = -n % self.local_size
            flat = F.pad(buffer, (0, pad)) if pad else buffer
            shard = torch.empty(flat.numel() // self.local_size, dtype=flat.dtype,
                                device=flat.device)
            seq = clock.begin(f"hierarchical all_reduce (DDP bucket {bucket.index()})", "dp") \
                if clock is not None else None
            dist.reduce_scatter_tensor(shard, flat, group=self.intra)
            dist.all_reduce(shard, group=self.inter)
            gathered = torch.empty_like(flat)
            dist.all_gather_into_tensor(gathered, shard, group=self.intra)
            if clock is not None and seq is not None:
                clock.end(seq)
            buffer.copy_(gathered[:n]).div_(size)
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(buffer)
            return fut
        return hook
