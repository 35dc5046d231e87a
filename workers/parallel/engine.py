"""Wires one training step from the spec's `parallel` section.

From the layout (workers/parallel/layout.py), over a `DeviceMesh` ("dp", "pp", "tp"):

* the model is cut into chunks (workers/parallel/pipeline.py): one per pipeline stage,
  or `virtual_stages` per rank for the interleaved schedule;
* tensor parallelism splits each block's projections (workers/parallel/tensor_parallel.py);
* data parallelism, by `zero_stage`:
    0  DDP (bucketed all-reduce overlapped with backward), with the chosen
       comm hook: fp16/bf16 compression, PowerSGD, or the hierarchical
       all-reduce (workers/parallel/comm_hooks.py);
    1  DDP plus ZeroRedundancyOptimizer (optimizer state sharded);
    2  FSDP2 `fully_shard` keeping parameters gathered between forward and
       backward (gradients and optimizer state sharded);
    3  FSDP2 resharding after forward (parameters sharded too);
  with `shard_group_size` (HSDP), 2 and 3 shard within groups of that many
  consecutive data-parallel ranks and replicate across the groups (FSDP2 over a
  2-D (replicate, shard) mesh: reduce-scatter in the group, all-reduce across);
  with tensor or pipeline parallelism and ZeRO 0 or 1, DDP does not apply
  (DTensor parameters; several backward passes per step), so gradients are
  all-reduced over the data-parallel group after backward;
* `offload` adds FSDP2's CPU offload policy; `precision` autocasts (or sets
  FSDP2's mixed-precision policy) and scales fp16 losses; `recompute`
  checkpoints activations; `training.compile` compiles each block.

The data-parallel pieces (the optimizer, DDP's comm hook, FSDP2 sharding, the
manual all-reduce) are data_parallel.py's; this module picks them per layout.
The trainer asks the engine for `forward_backward`, `clip` and `step`.
`holder` is the module to checkpoint: every parameter this rank holds, under
the whole model's names.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kuangchao.platform.spec.jobspec import JobSpec
from kuangchao.workers.data.shares import Shares
from kuangchao.workers.errors import TrainingError
from kuangchao.workers.parallel.comm_clock import CommClock
from kuangchao.workers.parallel.comm_hooks import Hierarchy
from kuangchao.workers.parallel.data_parallel import (
    allreduce_grads,
    comm_hook,
    device_mesh,
    fully_shard_chunk,
    hierarchy_wins,
    make_optimizer,
)
from kuangchao.workers.parallel.expert_wiring import wire_experts
from kuangchao.workers.parallel.layout import Coords, Layout, node_groups
from kuangchao.workers.parallel.microbatch import ComputeClock, accumulate, evaluate, run_pipeline
from kuangchao.workers.parallel.pipeline import (
    ChunkSet,
    TiedWeights,
    build_chunks,
    make_schedule,
    scaled_loss,
)
from kuangchao.workers.parallel.precision import Precision
from kuangchao.workers.parallel.prepare import recompute_blocks
from kuangchao.workers.parallel.sequence_parallel import reduce_partial_grads, wire_sequence_parallel
from kuangchao.workers.parallel.summary import describe
from kuangchao.workers.parallel.tensor_parallel import apply_tensor_parallel

Batch = tuple[torch.Tensor, torch.Tensor]


class Engine:
    """One rank's share of the model, wired for its layout.

    Args:
        spec: The job spec.
        model: The whole built-in model, identically initialised on every rank.
        rank, world_size: This rank's place in the default process group.
        device: Where it computes.
        node_of: Every rank's node, for the hierarchical all-reduce (rank -> node name).
        microbatches: Micro-batches per step (an elastic job's change with its size);
            with a pipeline, each is one pipeline micro-batch.
        clock: Times DDP's all-reduces for the worker's comm-share gauge.
        log: Where a warning (a compile fallback) is written.
        wrap: Wrap for data parallelism now; with False (plain DDP only) the
            caller sets `wrapped = wrap()` and `wired` later.
        layer_split: Layers per pipeline stage (from the stages' speeds,
            workers/parallel/balance.py); None: equal runs.
        emulation: A slower GPU emulated on CPU (workers/parallel/emulation.py).

    The data-parallel split of each step's samples is `shares` (`set_shares`; None:
    even). `compute` holds the last step's compute time and samples.
    """

    def __init__(self, spec: JobSpec, model: nn.Module, *, rank: int, world_size: int,
                 device: torch.device, node_of: dict[int, str] | None = None,
                 microbatches: int | None = None, clock: CommClock | None = None,
                 log: Callable[..., None] | None = None, wrap: bool = True,
                 layer_split: tuple[int, ...] | None = None, emulation: Any = None) -> None:
        p = self.p = spec.parallel
        self.spec, self.rank, self.world_size, self.device = spec, rank, world_size, device
        # A Hugging Face model's width is in its folder, not in the spec.
        self.d_model: int = getattr(model, "d_model", spec.model.d_model)
        self.clock, self.node_of = clock, node_of or {}
        self.microbatches = microbatches or p.gradient_accumulation_steps
        self.microbatches_even = self.microbatches
        self.log = log or (lambda msg, **kw: warnings.warn(msg, stacklevel=2))
        self.layout = Layout.of(p, world_size)
        self.coords: Coords = self.layout.coords(rank)
        self.distributed = world_size > 1 and dist.is_initialized()
        self.fsdp = p.zero_stage >= 2
        self.precision = Precision(p.precision, device, autocast=not self.fsdp)
        pp, tp, dp = self.layout.pp, self.layout.tp, self.layout.dp
        v = p.virtual_stages if pp > 1 else 1
        self.n_chunks = pp * v
        self.chunk_ids = self.layout.stage_chunks(self.coords.pp, v)
        self.layer_split = layer_split if pp > 1 and v == 1 else None
        if getattr(model, "opaque", False):  # a whole Hugging Face model: one chunk, uncut
            self.chunks = [model]
            self.holder = model
            if p.recompute:
                recompute_blocks(list(model.blocks.values()))
        else:
            self.chunks = build_chunks(model, self.n_chunks, self.chunk_ids, p.recompute,
                                       self.layer_split)
            self.holder = ChunkSet(self.chunks)
        self.emulation, self.shares, self.loss_factor = emulation, None, 1.0
        self.compute = ComputeClock(device, emulation)
        if pp > 1 and emulation is not None:  # per chunk: the schedule runs them piecemeal
            for chunk in self.chunks:
                chunk.emulation = emulation
        self.mesh = None
        if self.distributed and (pp > 1 or tp > 1 or self.fsdp or self.layout.ep > 1):
            self.mesh = device_mesh(device.type, self.layout)
        self.dp_group = self._group("dp")
        self.moe = wire_experts(self)  # None for a dense model; keeps this rank's experts
        self.pp_group = self._group("pp")
        self.tied = None
        if pp > 1 and self.distributed:
            firsts = [self.layout.rank(Coords(d, 0, t)) for d in range(dp) for t in range(tp)]
            lasts = [self.layout.rank(Coords(d, pp - 1, t)) for d in range(dp) for t in range(tp)]
            self.tied = TiedWeights(model, firsts, lasts, rank)
            if self.tied.duplicate(self.holder) is not None:
                self.holder.checkpoint_aliases = {"lm_head.weight": "tok_emb.weight"}
        if tp > 1 and self.mesh is not None:
            apply_tensor_parallel([b for c in self.chunks for b in c.blocks.values()], self.mesh["tp"],
                                  getattr(model, "tp_plan", None), p.sequence_parallel)
            if p.sequence_parallel:
                wire_sequence_parallel(self.chunks, self.mesh["tp"])
        if spec.training.compile:
            self._compile()
        # DDP takes neither DTensor (tensor-parallel) parameters nor a pipeline schedule's
        # several backward passes per step: there, with ZeRO 0 or 1, gradients are
        # all-reduced over the data-parallel group after backward, in one flat buffer.
        self.manual_dp = (tp > 1 or pp > 1 or self.layout.ep > 1) and not self.fsdp and dp > 1 \
            and self.distributed
        self.hierarchy: Hierarchy | None = None
        if not wrap and (self.mesh is not None or self.manual_dp):
            raise ValueError("only plain data parallelism may be wrapped later")
        self.wrapped = self.wrap() if wrap else list(self.chunks)
        self.wired = wrap
        self.optimizer = make_optimizer(self.holder, spec, zero=p.zero_stage == 1 and dp > 1,
                                        group=self.dp_group)
        self.schedule = self._schedule() if pp > 1 else None

    # -- wiring ---------------------------------------------------------------

    def _group(self, dim: str) -> dist.ProcessGroup | None:
        if self.mesh is not None:
            return self.mesh.get_group(dim)
        return None  # the default group: pure data parallelism, or one rank

    def _compile(self) -> None:
        """Compile each block in place (names unchanged); eager where it fails."""
        block = next(iter(self.chunks[0].blocks.values()))
        probe = torch.zeros(1, 2, self.d_model, device=self.device)
        # Under sequence parallelism the probe is one shard of a 2 x tp sequence.
        shards = getattr(self.chunks[0], "seq_shards", 1)
        extra = self.chunks[0].rope(2 * shards) if getattr(self.chunks[0], "rotary", False) else ()
        try:
            block.compile()
            with torch.no_grad():
                block(probe, *extra)
        except Exception as exc:  # inductor needs a compiler toolchain, and not every op lowers
            block._compiled_call_impl = None
            self.log(f"training.compile: torch.compile failed ({type(exc).__name__}: "
                     f"{str(exc).splitlines()[0][:200]}); running eagerly", level="WARNING")
            return
        for chunk in self.chunks:
            for b in chunk.blocks.values():
                b.compile()

    def wrap(self) -> list[nn.Module]:
        """Wrap every chunk for data parallelism; called again after a live resize."""
        dp = self.layout.dp
        if self.fsdp:
            return [fully_shard_chunk(c, self.p, self.mesh, self.precision.dtype, self.device)
                    for c in self.chunks]
        if dp == 1 or not self.distributed or self.manual_dp:
            return list(self.chunks)
        if self.layout.tp > 1 or self.layout.pp > 1:
            raise AssertionError("tensor-parallel and pipelined chunks are never wrapped in DDP")
        unsynced = self.spec.fault_tolerance.inject_unsynced_params
        if unsynced:
            names = {n for n, _ in self.holder.named_parameters()}
            unknown = sorted(set(unsynced) - names)
            if unknown:
                raise TrainingError(
                    f"fault_tolerance.inject_unsynced_params: no parameter(s) {unknown}; the model "
                    f"has {', '.join(sorted(names))}")
        out = []
        for chunk in self.chunks:
            if unsynced:  # the `kc debug gradient` drill: DDP leaves these out of its all-reduce
                names = {n for n, _ in chunk.named_parameters()}
                DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                    chunk, sorted(set(unsynced) & names))
            ddp = DistributedDataParallel(chunk, process_group=self.dp_group)
            hook = self._comm_hook()
            if hook is not None:
                ddp.register_comm_hook(*hook)
            out.append(ddp)
        return out

    def _comm_hook(self) -> tuple[Any, Callable] | None:
        return comm_hook(self.p, self.dp_group, self.clock, self._hierarchy)

    def _hierarchy(self) -> Hierarchy | None:
        """The node-by-node all-reduce, made once, when this job uses it."""
        if not self.use_hierarchy():
            return None
        if self.hierarchy is None:
            groups = node_groups(self.layout.dp_group(self.rank), self.node_of)
            assert groups is not None
            self.hierarchy = Hierarchy(groups, self.rank)
        return self.hierarchy

    def use_hierarchy(self) -> bool:
        """Whether the data-parallel all-reduce goes node by node."""
        mode = self.p.hierarchical_allreduce
        if mode == "off" or not self.node_of:
            return False
        groups = node_groups(self.layout.dp_group(self.rank), self.node_of)
        if groups is None:
            return False
        if mode == "on":
            return True
        return hierarchy_wins(self.spec, len(groups[0]), len(groups), self.device)

    def _schedule(self) -> Any:
        from torch.distributed.pipelining import PipelineStage

        stages = [PipelineStage(module, stage_index=i, num_stages=self.n_chunks, device=self.device,
                                group=self.pp_group)
                  for module, i in zip(self.wrapped, self.chunk_ids, strict=True)]
        return make_schedule(self.p.schedule, stages, self.microbatches,
                             scaled_loss(self.loss_factor))

    def set_shares(self, shares: Shares | None) -> None:
        """Take this step's data-parallel split (None or even: the even split). A pipeline
        replica's micro-batch count and weight follow its share: its schedule is rebuilt
        when they change (every stage of the replica does so at the same step)."""
        self.shares = None if shares is None or shares.is_even else shares
        if self.layout.pp == 1:
            return
        d = self.coords.dp
        count = len(self.shares.sizes(d)) if self.shares is not None else self.microbatches_even
        factor = self.shares.weight(d) if self.shares is not None else 1.0
        if (count, factor) != (self.microbatches, self.loss_factor):
            self.microbatches, self.loss_factor = count, factor
            self.schedule = self._schedule()

    def unwrap(self) -> None:
        """Drop the DDP wrappers (their hooks belong to a process group that is going away)."""
        self.wrapped = list(self.chunks)
        self.hierarchy = None
        self.wired = False

    def regroup(self, rank: int, world_size: int, microbatches: int) -> None:
        """Take the new world after a live resize (plain data parallelism only: the
        placement of shards and stages would change with it); `wrap` follows."""
        if self.mesh is not None:
            raise AssertionError("only plain data-parallel layouts resize in place")
        self.rank, self.world_size, self.microbatches = rank, world_size, microbatches
        self.microbatches_even, self.shares = microbatches, None
        self.layout = Layout.of(self.p, world_size)
        self.coords = self.layout.coords(rank)
        self.distributed = world_size > 1 and dist.is_initialized()

    def collectives(self) -> list[str]:
        """The token interfaces this layout's training step uses."""
        out = {"all_reduce"}  # HSDP's gradients cross the sharding groups by all-reduce
        if self.fsdp or self.hierarchy is not None:
            out |= {"reduce_scatter", "all_gather"}
        if self.p.zero_stage == 1:
            out.add("broadcast")
        if self.layout.pp > 1:
            out |= {"send", "recv"}
        if self.p.sequence_parallel and self.layout.tp > 1:
            out |= {"reduce_scatter", "all_gather"}
        if self.moe is not None:
            out |= self.moe.collectives()
        return sorted(out)

    def describe(self) -> str:
        """The layout in one line, for the job log."""
        return describe(self)

    # -- one step -------------------------------------------------------------

    @property
    def holds_first(self) -> bool:
        return 0 in self.chunk_ids

    @property
    def holds_last(self) -> bool:
        return self.n_chunks - 1 in self.chunk_ids

    def forward_backward(self, batches: list[Batch], poison: bool = False) -> float:
        """Forward and backward over one step's micro-batches; this rank's mean loss
        (sample-weighted: `shares.weight` makes it the global batch's in the mean over ranks).

        Gradients end up averaged over the data-parallel group, as a single
        process training on the whole global batch would have them.
        `poison` (a fault drill) makes the loss NaN.
        """
        self.compute = ComputeClock(self.device, self.emulation)
        if self.moe is not None:
            self.moe.begin_step(self, len(batches))
        if self.schedule is not None:
            loss = run_pipeline(self, batches, poison, self.compute)
        else:
            loss = accumulate(self, batches, poison, self.compute)
        if self.p.sequence_parallel:  # the norms' gradients, partial over the sequence shards
            reduce_partial_grads(self.holder)
        if self.manual_dp:  # experts' gradients meet in their own groups
            reduce = allreduce_grads if self.moe is None else self.moe.allreduce_grads
            reduce(self.holder, self.dp_group, self.layout.dp)
        if self.tied is not None:
            self.tied.sync(self.holder)
        return loss

    def _no_sync(self, module: nn.Module, last: bool):
        """Gradients meet once a step, at this rank's last micro-batch (ranks with uneven
        shares may run different numbers of them)."""
        if isinstance(module, DistributedDataParallel) and not last:
            return module.no_sync()
        if self.fsdp and hasattr(module, "set_requires_gradient_sync"):
            module.set_requires_gradient_sync(last)
        return nullcontext()

    def evaluate(self, batches: list[Batch]) -> float:
        """The mean loss of `batches`, forward only, dropout off (the eval split).

        With a pipeline, `batches` is one schedule's worth of micro-batches."""
        return evaluate(self, batches)

    def grad_norm(self) -> float:
        """The global gradient norm, over every stage and shard (the tied head counted once)."""
        skip = self.tied.duplicate(self.holder) if self.tied is not None else None
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for param in dict.fromkeys(self.holder.parameters()):
            if param.grad is None or param is skip:
                continue
            norm = torch.linalg.vector_norm(param.grad, dtype=torch.float32)
            if hasattr(norm, "full_tensor"):  # partial over the shards, replicated across HSDP
                norm = norm.full_tensor()     # groups: each shard counted once, no replica twice
            sq += norm.double() ** 2
        if self.moe is not None:  # experts held by this rank's expert-parallel peers
            sq += self.moe.other_experts_sq(self.holder, self.device)
        if self.pp_group is not None and self.layout.pp > 1:
            dist.all_reduce(sq, group=self.pp_group)
        return float(sq.sqrt())

    def clip(self, max_norm: float | None) -> float:
        """Unscale fp16 gradients, clip them to `max_norm`; the norm before clipping."""
        self.precision.unscale(self.optimizer)
        norm = self.grad_norm()
        if max_norm is not None and norm == norm and norm > max_norm:
            coef = max_norm / (norm + 1e-6)
            for param in dict.fromkeys(self.holder.parameters()):
                if param.grad is not None:
                    param.grad.mul_(coef)
        return norm

    def step(self) -> None:
        self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)

    def skip(self) -> None:
        """Skip an fp16 step whose gradients overflowed; the loss scale comes down."""
        self.precision.skip(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
