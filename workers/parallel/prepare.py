"""The spec's layout on any `nn.Module`: what `ctx.prepare_model` does for a user's own
train function (Ray Train's `prepare_model`, plus ZeRO and tensor parallelism).

- data parallelism by `zero_stage`: DDP (0 and 1), FSDP2 per decoder layer then
  the whole model (2: parameters kept gathered between forward and backward,
  3: resharded), with `offload` and `precision` as FSDP2's policies;
- tensor parallelism over the ranks of one replica: the plan the caller gives,
  else a Hugging Face model's own (`base_model_tp_plan`), else the one kc keeps
  for its family; then FSDP2 over the data-parallel dimension of a (dp, pp=1, tp)
  mesh (HSDP: sharded within groups of `shard_group_size`, replicated across);
- `recompute` (activations of each decoder layer recomputed in backward) and
  `training.compile` (each decoder layer compiled).

Pipelines are the built-in trainer's (it cuts a model into stages and runs the
schedule); a function asking for one is refused with the field to change.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from kuangchao.platform.spec.jobspec import JobSpec
from kuangchao.platform.spec.model import FAMILY_TP_PLANS
from kuangchao.workers.errors import TrainingError
from kuangchao.workers.parallel.data_parallel import device_mesh, fully_shard_blocks
from kuangchao.workers.parallel.expert_wiring import count_globally
from kuangchao.workers.parallel.layout import Layout
from kuangchao.workers.parallel.precision import Precision
from kuangchao.workers.parallel.tensor_parallel import STYLES


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated layers: the longest `ModuleList` of one class (a decoder's layers)."""
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            kinds = {type(m) for m in module}
            if len(kinds) == 1:
                best = list(module)
    return best


def hf_plan(model: nn.Module) -> dict[str, str] | None:
    """A Hugging Face model's tensor-parallel plan by module path from the model's root
    (`model.layers.*.self_attn.q_proj`), from its config or kc's plan for its family."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    plan = getattr(config, "base_model_tp_plan", None) or {
        f"layers.*.{k}": v for k, v in FAMILY_TP_PLANS.get(getattr(config, "model_type", ""), {}).items()}
    prefix = getattr(model, "base_model_prefix", "model")
    base = f"{prefix}." if hasattr(model, prefix) else ""
    return {f"{base}{k}": v for k, v in plan.items() if v in STYLES} or None


def _recompute(block: nn.Module) -> None:
    """Recompute the block's activations in backward; its parameter names stay as they are."""
    forward = block.forward

    @functools.wraps(forward)
    def recomputed(*args: Any, **kwargs: Any) -> Any:
        if not block.training:
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = recomputed  # type: ignore[method-assign]


def recompute_blocks(blocks: list[nn.Module]) -> None:
    """Recompute each block's activations in backward (names unchanged)."""
    for block in blocks:
        _recompute(block)


def prepare_model(spec: JobSpec, model: nn.Module, *, world_size: int, device: torch.device,
                  tp_plan: dict[str, str] | None = None) -> nn.Module:
    """Lay `model` out as the spec says, on this rank; returns what to call and train.

    Args:
        tp_plan: Module path (wildcards `*` allowed, from the model's root) ->
            "colwise" | "rowwise"; default: the model's own (`hf_plan`).

    Raises:
        TrainingError: The layout cannot apply to this model; names the field to change.
    """
    p = spec.parallel
    layout = Layout.of(p, world_size)
    if layout.pp > 1:
        raise TrainingError("parallel.pipeline_parallel_size: prepare_model does not cut a model "
                            "into pipeline stages; set it to 1 in your own function, or train a "
                            "Hugging Face model with the built-in trainer (model.type hf)")
    model = model.to(device)
    blocks = find_blocks(model)
    if p.recompute:
        recompute_blocks(blocks)
    if spec.training.compile:
        for block in blocks:
            block.compile()
    distributed = world_size > 1 and dist.is_initialized()
    if not distributed:
        return model
    mesh = None
    if layout.tp > 1 or p.zero_stage >= 2:
        mesh = device_mesh(device.type, layout)  # pp is 1 here; HSDP groups when asked
    count_globally(model, mesh, layout.coords(dist.get_rank()).dp)  # a mixture of experts'
    if layout.tp > 1:
        plan = tp_plan or hf_plan(model)
        if not plan:
            raise TrainingError("parallel.tensor_parallel_size: this model carries no tensor-"
                                "parallel plan; pass ctx.prepare_model(model, tp_plan={...}) or "
                                "set tensor_parallel_size: 1")
        if layout.dp > 1 and p.zero_stage < 2:
            raise TrainingError("parallel.zero_stage: with tensor parallelism, prepare_model "
                                "shards the data-parallel dimension with FSDP2; set zero_stage 2 or 3")
        from torch.distributed.tensor.parallel import parallelize_module

        bad = sorted({v for v in plan.values() if v not in STYLES})
        if bad:
            raise TrainingError(f"tp_plan: {', '.join(bad)} is not a style kc applies; use colwise "
                                "or rowwise")
        assert mesh is not None
        parallelize_module(model, mesh["tp"], {k: STYLES[v]() for k, v in plan.items()})
    if p.zero_stage >= 2:
        dtype = Precision(p.precision, device, autocast=False).dtype
        return fully_shard_blocks(model, blocks, p, mesh, dtype, device)
    if layout.dp > 1:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The module under a DDP wrapper (FSDP2 and tensor parallelism wrap nothing)."""
    return getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" \
        else model
