"""What a mixture of experts (`model.type: moe`) and expert parallelism can run with.

The built-in MoE model (workers/models/moe.py) is a Llama-style decoder whose
MLPs are `n_experts` SwiGLU experts behind a top-`top_k` router. Expert
parallelism (`parallel.expert_parallel_size`, EP) splits each layer's experts
over EP ranks carved out of the data-parallel dimension: dense weights stay
replicated over every data-parallel rank, an expert's weights over the
`data_parallel_size / expert_parallel_size` ranks that hold it. Tokens reach
their experts and come back through `all_to_all` (workers/parallel/expert_parallel.py).

Every combination the worker cannot run is refused here, each naming the field
to change, so no MoE job fails on its layout mid-run. Pure: no pydantic, no torch.
"""

from __future__ import annotations

from typing import Any

MOE_TYPE = "moe"
# The MoE fields and their defaults; any other model type must leave them at these.
MOE_FIELDS = {"n_experts": 8, "top_k": 2, "capacity_factor": 1.25, "aux_loss_coef": 0.01,
              "z_loss_coef": 0.001}


def moe_field_errors(m: Any) -> list[tuple[str, str]]:
    """The model section's MoE fields: only for type moe, and `top_k` within `n_experts`."""
    if m.type != MOE_TYPE:
        return [(f"model.{name}", "is for model.type moe only (a mixture of experts); "
                 "remove it, or set model.type: moe")
                for name, default in MOE_FIELDS.items() if getattr(m, name) != default]
    if m.top_k > m.n_experts:
        return [("model.top_k", f"{m.top_k} exceeds model.n_experts ({m.n_experts}); each token "
                                "goes to top_k distinct experts")]
    return []


def expert_layout_errors(p: Any, builtin_trainer: bool) -> list[tuple[str, str]]:
    """What `parallel.expert_parallel_size` cannot run with, from the layout alone
    (the model's side is `moe_errors`)."""
    ep = p.expert_parallel_size
    if ep == 1:
        return []
    field = "parallel.expert_parallel_size"
    if not builtin_trainer:
        return [(field, "experts are split by the built-in trainer; a custom entrypoint runs "
                        "them with expert_parallel_size: 1 (data parallelism and ZeRO)")]
    errs: list[tuple[str, str]] = []
    dp = p.data_parallel_size
    if not p.auto and dp % ep:
        errs.append((field, f"{ep} does not divide data_parallel_size ({dp}); expert-parallel "
                            "ranks are carved out of the data-parallel ones"))
    if p.zero_stage == 1:
        errs.append(("parallel.zero_stage", "ZeRO-1 (ZeroRedundancyOptimizer) assumes every "
                     "data-parallel rank holds the same parameters, and expert-parallel ranks "
                     "hold different experts; use zero_stage 0, 2 or 3"))
    if p.shard_group_size is not None:
        errs.append(("parallel.shard_group_size", "HSDP sharding groups do not combine with "
                     "expert parallelism; remove shard_group_size, or set expert_parallel_size: 1"))
    if p.grad_compression != "none" or p.hierarchical_allreduce == "on":
        name = "grad_compression" if p.grad_compression != "none" else "hierarchical_allreduce"
        errs.append((f"parallel.{name}", "is a DDP comm hook, and an expert-parallel model is "
                     "not wrapped in DDP (expert and dense gradients meet in different groups); "
                     f"set {name}: {'none' if name == 'grad_compression' else 'auto'}"))
    return errs


def moe_errors(spec: Any) -> list[tuple[str, str]]:
    """The rules between a mixture of experts and the rest of the spec."""
    m, p = spec.model, spec.parallel
    ep = p.expert_parallel_size
    if m.type != MOE_TYPE:
        if ep > 1:
            return [("parallel.expert_parallel_size", f"{ep} splits the experts of a mixture of "
                     f"experts; model.type {m.type!r} has none: set model.type: moe, or "
                     "expert_parallel_size: 1")]
        return []
    errs: list[tuple[str, str]] = []
    if m.n_experts % ep:
        errs.append(("parallel.expert_parallel_size", f"{ep} does not divide model.n_experts "
                     f"({m.n_experts}); every expert-parallel rank holds the same number of experts"))
    if p.precision == "fp16":
        errs.append(("parallel.precision", "the router's auxiliary losses are added to the "
                     "gradients unscaled, outside fp16's loss scaling; use precision: bf16 "
                     "(or fp32) with model.type moe"))
    dp = p.data_parallel_size
    balanced = spec.resources.heterogeneous and spec.resources.balance == "speed"
    if balanced and dp > 1 and spec.entrypoint is None:
        errs.append(("resources.balance", "expert capacity is counted over every data-parallel "
                     "rank's micro-batch at once, so every rank runs the same micro-batches; set "
                     "balance: even for a mixture of experts on mixed GPU types"))
    if spec.training.compile:
        errs.append(("training.compile", "a mixture of experts routes by data-dependent counts "
                     "and gathers them across ranks inside each layer, which torch.compile does "
                     "not trace; set training.compile: false"))
    if spec.fault_tolerance.inject_unsynced_params and ep > 1:
        errs.append(("fault_tolerance.inject_unsynced_params", "the drill leaves parameters out "
                     "of DDP's all-reduce, and an expert-parallel model is not wrapped in DDP; "
                     "use expert_parallel_size: 1"))
    return errs
