"""The job spec's `parallel` section: the layout, and which layouts can run.

A layout is `data_parallel_size x pipeline_parallel_size x tensor_parallel_size`
ranks (rank = (dp_index * pp + stage) * tp + tp_index, as placement lays
them out), plus how each dimension is carried out: the ZeRO stage, the
pipeline schedule, precision, gradient compression. The worker wires it from
these fields (workers/parallel/layout.py). `expert_parallel_size` splits a mixture
of experts' experts over data-parallel ranks; its rules are platform/spec/moe.py's.
`parallel: auto` asks the planner (platform/planning/planner.py) for the layout at
submission instead.

Every combination the worker cannot run is refused here, at validation time,
with the field to change: a job must never fail on its layout mid-run.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kuangchao.platform.spec.moe import expert_layout_errors

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
PRECISIONS = ("fp32", "bf16", "fp16")
COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")


class ParallelSection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    data_parallel_size: int = Field(1, ge=1, le=65536)
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    # Megatron's sequence parallelism inside the tensor-parallel group: norms and dropout
    # run on sequence shards; reduce-scatter and all-gather replace each all-reduce.
    sequence_parallel: bool = False
    pipeline_parallel_size: int = Field(1, ge=1, le=1024)
    # Experts of a mixture of experts split over this many of the data-parallel ranks
    # (it divides data_parallel_size; platform/spec/moe.py).
    expert_parallel_size: int = Field(1, ge=1, le=1024)
    micro_batch_size: int = Field(8, ge=1)
    # With a pipeline, each accumulation step is one pipeline micro-batch.
    gradient_accumulation_steps: int = Field(1, ge=1)
    gpus_per_rank: int = Field(1, ge=0, le=16)
    cpus_per_rank: float = Field(1.0, gt=0)
    # 0: DDP; 1: optimizer state sharded (ZeroRedundancyOptimizer); 2: also gradients,
    # 3: also parameters (both FSDP2).
    zero_stage: Literal[0, 1, 2, 3] = 0
    # HSDP: with zero_stage 2 or 3, shard within groups of this many data-parallel ranks
    # (2 or more, consecutive, so a node or an island when placement keeps them together)
    # and replicate across the groups. None: one group, the whole data-parallel dimension.
    # An elastic job resizes in whole groups.
    shard_group_size: int | None = Field(None, ge=1, le=65536)
    # Parameters, gradients and optimizer state live in host memory (FSDP2's offload policy).
    offload: bool = False
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    # Model chunks per pipeline rank; interleaved_1f1b needs 2 or more.
    virtual_stages: int = Field(1, ge=1, le=64)
    # Activation checkpointing: each block's activations are recomputed in backward.
    recompute: bool = False
    # Autocast precision; parameters and optimizer state stay fp32 (the master weights).
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # DDP gradient compression hook.
    grad_compression: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    powersgd_rank: int = Field(1, ge=1, le=64)
    # Reduce-scatter in the node, all-reduce across nodes, all-gather in the node. auto: when
    # the planner's cost model says it beats a flat all-reduce.
    hierarchical_allreduce: Literal["auto", "on", "off"] = "auto"
    # parallel: auto -- the planner chooses dp/tp/pp, micro-batch, ZeRO stage, recompute
    # and schedule at submission; `gpus` ranks are laid out on accelerator `gpu`.
    auto: bool = False
    gpus: int | None = Field(None, ge=1, le=65536)
    gpu: str | None = Field(None, min_length=1, max_length=64)
    global_batch: int | None = Field(None, ge=1)

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def hybrid(self) -> bool:
        """Whether anything beyond plain DDP replicas is wired (live resizes need plain DDP)."""
        return (self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1
                or self.zero_stage > 0 or self.expert_parallel_size > 1)


DEFAULT_COLLECTIVES = ("all_gather", "all_reduce", "barrier", "broadcast", "reduce_scatter")


def expand_auto(data: Any) -> Any:
    """`parallel: auto` is shorthand for `parallel: {auto: true}`; a pipeline's
    point-to-point sends, and expert parallelism's all_to_all, join the default
    collectives when none are listed."""
    if not isinstance(data, dict):
        return data
    if data.get("parallel") == "auto":
        data = {**data, "parallel": {"auto": True}}
    par, perm = data.get("parallel"), data.get("permission")
    pp = par.get("pipeline_parallel_size", 1) if isinstance(par, dict) else 1
    ep = par.get("expert_parallel_size", 1) if isinstance(par, dict) else 1
    brought = ({"recv", "send"} if isinstance(pp, int) and pp > 1 else set()) \
        | ({"all_to_all"} if isinstance(ep, int) and ep > 1 else set())
    if not brought:
        return data
    if perm is None or (isinstance(perm, dict) and "collectives" not in perm
                        and "allowed_interfaces" not in perm):
        perm = dict(perm or {})
        perm["collectives"] = [*DEFAULT_COLLECTIVES, *sorted(brought)]
        return {**data, "permission": perm}
    # The built-in trainer's pipeline passes activations between its own stages, and its
    # expert parallelism tokens between its own ranks: such a layout brings its send and
    # recv, or its all_to_all, with it, whatever else the list allows (the design
    # documents' job lists only all_reduce, all_gather and broadcast).
    if isinstance(perm, dict) and data.get("entrypoint") is None:
        key = "allowed_interfaces" if "allowed_interfaces" in perm else "collectives"
        listed = perm.get(key)
        if isinstance(listed, list) and "collectives" in perm and "allowed_interfaces" in perm:
            return data  # both given: validation says so
        if isinstance(listed, list) and not brought <= set(listed):
            perm = {**perm, key: [*listed, *sorted(brought - set(listed))]}
            return {**data, "permission": perm}
    return data


def parallel_errors(p: ParallelSection, n_layers: int | None, n_heads: int | None,
                    builtin_trainer: bool, *, seq_len: int | None = None,
                    builtin_model: bool = True) -> list[tuple[str, str]]:
    """Layouts the worker cannot run, each with the field to change.

    `n_layers` and `n_heads` are None for a model whose shape is in its folder
    (a Hugging Face model), whose checks run where the folder is read.
    `seq_len` (None: not checked) and `builtin_model` (gpt, llama, moe: not a
    Hugging Face folder or a custom factory) are read by sequence parallelism."""
    errs: list[tuple[str, str]] = sequence_parallel_errors(p, seq_len, builtin_model,
                                                           builtin_trainer)
    tp, pp = p.tensor_parallel_size, p.pipeline_parallel_size
    if n_heads is not None and n_heads % tp:
        errs.append(("parallel.tensor_parallel_size",
                     f"{tp} does not divide model.n_heads ({n_heads})"))
    chunks = pp * p.virtual_stages
    if n_layers is None:
        pass
    elif n_layers % pp:
        errs.append(("parallel.pipeline_parallel_size",
                     f"{pp} does not divide model.n_layers ({n_layers})"))
    elif n_layers % chunks:
        errs.append(("parallel.virtual_stages",
                     f"pipeline_parallel_size x virtual_stages ({chunks}) does not divide "
                     f"model.n_layers ({n_layers}); each model chunk holds whole layers"))
    if p.auto:
        for name in ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(p, name) != 1:
                errs.append((f"parallel.{name}", "is chosen by the planner with parallel.auto; "
                             "remove it, or set parallel.auto: false"))
    else:
        for name in ("gpus", "gpu", "global_batch"):
            if getattr(p, name) is not None:
                errs.append((f"parallel.{name}", "is read only by the planner; set parallel.auto: "
                             "true, or give data_parallel_size, tensor_parallel_size and "
                             "pipeline_parallel_size"))
    # `ctx.prepare_model` wires sharding groups as the built-in trainer does: both kinds of job.
    errs.extend(shard_group_errors(p))
    errs.extend(expert_layout_errors(p, builtin_trainer))
    if not builtin_trainer:
        return errs  # a custom entrypoint wires its own layout from the fields
    if p.schedule == "interleaved_1f1b" and pp > 1:
        if p.virtual_stages < 2:
            errs.append(("parallel.virtual_stages", "interleaved_1f1b needs 2 or more model "
                         "chunks per pipeline rank; set virtual_stages: 2, or schedule: 1f1b"))
        if p.gradient_accumulation_steps % pp:
            errs.append(("parallel.gradient_accumulation_steps",
                         f"interleaved_1f1b needs the micro-batches per step "
                         f"({p.gradient_accumulation_steps}) to be a multiple of "
                         f"pipeline_parallel_size ({pp})"))
    elif p.virtual_stages > 1:
        errs.append(("parallel.virtual_stages", "only the interleaved_1f1b schedule runs more "
                     "than one model chunk per rank; set schedule: interleaved_1f1b and "
                     "pipeline_parallel_size above 1, or virtual_stages: 1"))
    if pp > 1 and p.gradient_accumulation_steps < pp and p.schedule != "gpipe":
        errs.append(("parallel.gradient_accumulation_steps",
                     f"a {pp}-stage {p.schedule} pipeline needs at least {pp} micro-batches per "
                     f"step to fill; set it to {pp} or more (each is one pipeline micro-batch)"))
    if p.offload and p.zero_stage < 2:
        errs.append(("parallel.offload", "offloading runs through FSDP2; set zero_stage: 2 or 3"))
    if p.zero_stage == 1 and tp > 1:
        errs.append(("parallel.zero_stage", "ZeRO-1 (ZeroRedundancyOptimizer) shards plain "
                     "tensors, not tensor-parallel ones; use zero_stage 2 or 3 with "
                     "tensor_parallel_size above 1"))
    if p.grad_compression != "none":
        if p.zero_stage >= 2:
            errs.append(("parallel.grad_compression", "compression is a DDP comm hook; FSDP "
                         "(zero_stage 2 and 3) has none: use zero_stage 0 or 1, or grad_compression: none"))
        elif tp > 1 or pp > 1:
            errs.append(("parallel.grad_compression", "compression is a DDP comm hook, and "
                         "tensor-parallel and pipelined models are not wrapped in DDP; "
                         "set grad_compression: none"))
    if p.hierarchical_allreduce == "on":
        if p.zero_stage >= 2 or tp > 1 or pp > 1:
            errs.append(("parallel.hierarchical_allreduce", "the hierarchical all-reduce is a "
                         "DDP comm hook: it needs zero_stage 0 or 1, and tensor_parallel_size "
                         "and pipeline_parallel_size 1"))
        elif p.grad_compression != "none":
            errs.append(("parallel.hierarchical_allreduce", "one DDP comm hook per model: choose "
                         "hierarchical_allreduce or grad_compression, not both"))
    if p.precision == "fp16" and p.zero_stage >= 2:
        errs.append(("parallel.precision", "fp16 needs dynamic loss scaling, which FSDP2 "
                     "(zero_stage 2 and 3) does not carry here; use precision: bf16"))
    if p.precision == "fp16" and pp > 1:
        errs.append(("parallel.precision", "fp16 loss scaling does not reach inside a pipeline "
                     "schedule's backward; use precision: bf16 with pipeline_parallel_size above 1"))
    return errs


def sequence_parallel_errors(p: ParallelSection, seq_len: int | None, builtin_model: bool,
                             builtin_trainer: bool) -> list[tuple[str, str]]:
    """What sequence parallelism cannot run with; empty without it.

    It is wired by the built-in trainer for the built-in models, whose blocks it
    knows (workers/parallel/sequence_parallel.py); each sequence splits into
    tensor_parallel_size equal shards. With `parallel.auto` the planner picks the
    tensor-parallel size, and its layouts are checked again (`layout_errors`)."""
    if not p.sequence_parallel:
        return []
    field = "parallel.sequence_parallel"
    tp = p.tensor_parallel_size
    if not builtin_trainer:
        return [(field, "is wired by the built-in trainer only (ctx.prepare_model applies "
                        "tensor parallelism without it); remove the entrypoint, or set "
                        "sequence_parallel: false")]
    if not builtin_model:
        return [(field, "shards the built-in models' blocks (gpt, llama, moe); a Hugging Face "
                        "or custom model runs tensor parallelism without it: set "
                        "sequence_parallel: false")]
    if p.auto:
        return []
    if tp == 1:
        return [(field, "shards activations over the tensor-parallel group, and "
                        "tensor_parallel_size is 1; set tensor_parallel_size to 2 or more, "
                        "or sequence_parallel: false")]
    if seq_len is not None and seq_len % tp:
        return [(field, f"splits each sequence into tensor_parallel_size ({tp}) equal shards, "
                        f"and {tp} does not divide model.seq_len ({seq_len}); change "
                        "tensor_parallel_size or model.seq_len, or set sequence_parallel: false")]
    return []


def shard_group_errors(p: ParallelSection) -> list[tuple[str, str]]:
    """What HSDP (`shard_group_size`) cannot run with; empty without it.

    It runs with everything FSDP2 (zero_stage 2 and 3) runs with: tensor and
    pipeline parallelism, offload, bf16, recompute. A resize (elastic jobs restart
    with a new data-parallel size) keeps to multiples of the group
    (`ElasticRange.admissible`); a size equal to the group is plain FSDP."""
    s = p.shard_group_size
    if s is None:
        return []
    field = "parallel.shard_group_size"
    if p.auto:
        return [(field, "is chosen by the planner with parallel.auto; remove it, or set "
                        "parallel.auto: false and give the layout")]
    if p.zero_stage < 2:
        return [(field, "sharding groups are FSDP2's (HSDP); set zero_stage: 2 or 3, or remove "
                        "shard_group_size")]
    if s == 1:
        # Nothing would be sharded: every rank holding the whole model, its gradients and
        # optimizer state is DDP, which overlaps its bucketed all-reduce with backward.
        return [(field, "1 shards nothing (every rank would hold the whole model, gradients and "
                        "optimizer state); use zero_stage: 0 (DDP) to replicate, or a group of "
                        "2 or more ranks")]
    if p.data_parallel_size % s:
        return [(field, f"{s} does not divide data_parallel_size ({p.data_parallel_size}); the "
                        "data-parallel ranks split into whole sharding groups: use a divisor, or "
                        "remove shard_group_size to shard over all of them")]
    return []


def trainer_collectives(p: ParallelSection) -> set[str]:
    """The collectives the built-in trainer runs for this layout (the token must allow them)."""
    out = {"all_reduce", "broadcast", "all_gather"}
    # FSDP2 all-gathers parameters and reduce-scatters gradients (within each sharding
    # group under HSDP, whose groups then all-reduce them).
    if p.zero_stage >= 2 or p.hierarchical_allreduce == "on":
        out.add("reduce_scatter")
    if p.pipeline_parallel_size > 1:
        out |= {"send", "recv"}
    if p.expert_parallel_size > 1:  # tokens to their experts' ranks and back
        out.add("all_to_all")
    if p.sequence_parallel:  # the row-parallel outputs are reduce-scattered to sequence shards
        out |= {"all_gather", "reduce_scatter"}
    return out
