"""The data-parallel half of the wiring: the device mesh, the optimizer (sharded for
ZeRO-1), how DDP's gradients travel (compression, PowerSGD, the node-by-node
all-reduce, or timed plain all-reduce), FSDP2 sharding for ZeRO 2 and 3 (HSDP
with sharding groups), and the manual all-reduce for tensor-parallel or
pipelined chunks that DDP cannot wrap.

Split from engine.py, which decides which of these a layout uses and holds the
state between steps; everything here takes what it needs as arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kuangchao.platform.spec.jobspec import JobSpec
from kuangchao.platform.spec.parallel import ParallelSection
from kuangchao.workers.parallel.comm_clock import CommClock
from kuangchao.workers.parallel.comm_hooks import Hierarchy, compress_hook, powersgd, timed_allreduce_hook
from kuangchao.workers.parallel.expert_wiring import shard_experts
from kuangchao.workers.parallel.layout import Layout

# HSDP's two halves of the data-parallel dimension (replicate across groups, shard within).
HSDP_DIMS = ("dp_replicate", "dp_shard")


def device_mesh(device_type: str, layout: Layout) -> Any:
    """The `DeviceMesh` over every rank: ("dp", "pp", "tp"), or with HSDP
    ("dp_replicate", "dp_shard", "pp", "tp"), or with expert parallelism ("edp", "ep",
    "pp", "tp"), with the first two also flattened into "dp" (the whole data-parallel
    group, as without them)."""
    from torch.distributed.device_mesh import init_device_mesh

    if layout.ep > 1:  # ("edp", "ep") flattened into "dp" (workers/parallel/expert_parallel.py)
        mesh = init_device_mesh(device_type, (layout.dp // layout.ep, layout.ep, layout.pp,
                                              layout.tp), mesh_dim_names=("edp", "ep", "pp", "tp"))
        mesh[("edp", "ep")]._flatten("dp")
        return mesh
    if layout.shard_group is None:
        return init_device_mesh(device_type, (layout.dp, layout.pp, layout.tp),
                                mesh_dim_names=("dp", "pp", "tp"))
    mesh = init_device_mesh(device_type, (layout.shard_groups, layout.shard_group, layout.pp,
                                          layout.tp), mesh_dim_names=(*HSDP_DIMS, "pp", "tp"))
    mesh[HSDP_DIMS]._flatten("dp")
    return mesh


def fsdp_mesh(mesh: Any) -> Any:
    """The mesh FSDP2 shards over: 1-D "dp" (FSDP), or 2-D (replicate, shard) for HSDP,
    which FSDP2 takes as: parameters `(Replicate(), Shard(0))`, gradients
    reduce-scattered within the group and all-reduced across the groups."""
    if HSDP_DIMS[1] in (mesh.mesh_dim_names or ()):
        return mesh[HSDP_DIMS]
    return mesh["dp"]


def make_optimizer(model: nn.Module, spec: JobSpec, zero: bool = False,
                   group: dist.ProcessGroup | None = None) -> torch.optim.Optimizer:
    """AdamW or SGD; with `zero`, its state sharded over `group` (ZeRO-1)."""
    o = spec.optimizer
    # Biases and norm weights (1-D) are not decayed, as is usual for transformers.
    params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if o.type == "sgd":
        cls: type[torch.optim.Optimizer] = torch.optim.SGD
        kwargs: dict[str, Any] = {"lr": o.lr, "momentum": o.momentum}
    else:
        cls, kwargs = torch.optim.AdamW, {"lr": o.lr, "betas": o.betas}
    if not zero:
        return cls(groups, **kwargs)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    opt = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=cls, process_group=group,
                                  weight_decay=o.weight_decay, **kwargs)
    opt.add_param_group({"params": no_decay, "weight_decay": 0.0})
    return opt


def comm_hook(p: ParallelSection, dp_group: dist.ProcessGroup | None, clock: CommClock | None,
              hierarchy: Callable[[], Hierarchy | None]) -> tuple[Any, Callable] | None:
    """The (state, hook) DDP registers for `p`'s gradient transport; None for its default.

    Args:
        hierarchy: The node-by-node all-reduce when the job uses it, else None; asked
            only when no compression is set, since compression takes precedence.
    """
    if p.grad_compression in ("fp16", "bf16"):
        dtype = torch.float16 if p.grad_compression == "fp16" else torch.bfloat16
        return None, compress_hook(dtype, clock)
    if p.grad_compression == "powersgd":
        return powersgd(dp_group, p.powersgd_rank)
    two_level = hierarchy()
    if two_level is not None:
        return None, two_level.hook(clock)
    if clock is not None:
        return None, timed_allreduce_hook(clock)
    return None


def hierarchy_wins(spec: JobSpec, ranks_per_node: int, nodes: int, device: torch.device) -> bool:
    """The planner's verdict: is the two-level all-reduce cheaper for this job's gradients?"""
    from kuangchao.platform.cluster.hardware import get_accelerator
    from kuangchao.platform.planning.cost import allreduce_costs
    from kuangchao.platform.planning.shapes import ModelShape

    shape = ModelShape.from_spec_model(spec.model.model_dump())
    grad_bytes = 4 * shape.params / (spec.parallel.tensor_parallel_size
                                     * spec.parallel.pipeline_parallel_size)
    # Without `parallel.gpu` the device decides; any GPU is priced as an H100.
    acc = get_accelerator(spec.parallel.gpu or ("cpu" if device.type == "cpu" else "h100-80gb"))
    flat, hier = allreduce_costs(grad_bytes, ranks_per_node * nodes, ranks_per_node, acc)
    return hier < flat


def fully_shard_chunk(chunk: nn.Module, p: ParallelSection, mesh: Any, dtype: torch.dtype | None,
                      device: torch.device) -> nn.Module:
    """FSDP2 over each block of `chunk`, then the chunk (ZeRO 2 keeps parameters gathered
    between forward and backward, ZeRO 3 reshards them after forward)."""
    return fully_shard_blocks(chunk, list(chunk.blocks.values()), p, mesh, dtype, device)


def fully_shard_blocks(root: nn.Module, blocks: list[nn.Module], p: ParallelSection, mesh: Any,
                       dtype: torch.dtype | None, device: torch.device) -> nn.Module:
    """FSDP2 over each of `blocks`, then over `root` (what is left: embeddings, head); over
    `mesh`'s data-parallel dimension, split into sharding groups where it has them (HSDP)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"reshard_after_forward": p.zero_stage == 3}
    if mesh is not None:
        kwargs["mesh"] = fsdp_mesh(mesh)
    if dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if p.offload:
        # Page-locking host memory needs an accelerator; on a CPU the state is already there.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in blocks:
        shard_experts(block, mesh, kwargs)  # a mixture of experts' under EP, over their own ranks
        fully_shard(block, **kwargs)
    return fully_shard(root, **kwargs)


def allreduce_grads(holder: nn.Module, dp_group: dist.ProcessGroup | None, dp: int) -> None:
    """Average the gradients over the data-parallel group in one flat buffer (DTensor
    gradients by their local shard), where DDP could not wrap the chunks."""
    grads = [p.grad for p in holder.parameters() if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    flat = torch._utils._flatten_dense_tensors(local)
    dist.all_reduce(flat, group=dp_group)
    flat.div_(dp)
    for g, synced in zip(local, torch._utils._unflatten_dense_tensors(flat, local), strict=True):
        g.copy_(synced)
