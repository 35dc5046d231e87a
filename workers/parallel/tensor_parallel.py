"""Megatron-style tensor parallelism for the built-in models, with DTensor.

In every block, attention's q/k/v projections and the MLP's up (and gate)
projections are split by output column, each rank computing its share of the
heads and hidden units; attention's output projection and the MLP's down
projection are split by input row, and their outputs are summed over the
group. That is one all-reduce after attention and one after the MLP in the
forward pass, and one each in backward. Embeddings, norms and the head stay
whole on every rank of the group.

With `sequence_parallel`, the norms and dropouts between those regions run on
sequence shards, and each all-reduce becomes a reduce-scatter and an all-gather
(workers/parallel/sequence_parallel.py).

A Hugging Face model brings its own plan (its config's `base_model_tp_plan`,
or the one kc keeps for its family: platform/spec/model.py), by submodule path
inside a decoder layer. Its attention reshapes with `-1` heads, so it needs no
head count changed.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from kuangchao.workers.parallel.expert_parallel import expert_plan
from kuangchao.workers.parallel.sequence_parallel import sequence_block_plan


def block_plan(block: nn.Module) -> dict[str, ColwiseParallel | RowwiseParallel]:
    """The column/row split of one block's projections, by submodule path."""
    plan: dict[str, ColwiseParallel | RowwiseParallel] = {
        "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(),
    }
    if hasattr(block, "moe"):  # a mixture of experts: each expert this rank holds splits
        return {**plan, **expert_plan(block.moe)}  # as a SwiGLU MLP does
    plan.update({"mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    if hasattr(block.mlp, "gate_proj"):  # Llama's SwiGLU
        plan["mlp.gate_proj"] = ColwiseParallel()
    return plan


STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def apply_tensor_parallel(blocks: list[nn.Module], mesh: DeviceMesh,
                          plan: dict[str, str] | None = None,
                          sequence_parallel: bool = False) -> None:
    """Split each block over the 1-D tensor-parallel `mesh`, in place.

    `plan`: a Hugging Face model's, submodule path -> "colwise" | "rowwise";
    None: the built-in models' (`block_plan`). `sequence_parallel`: shard the
    activations between the splits along the sequence (its gathers and the model's
    ends are `sequence_parallel.wire_sequence_parallel`'s, called next)."""
    tp = mesh.size()
    if plan is not None and sequence_parallel:
        raise ValueError("parallel.sequence_parallel: Hugging Face models run tensor "
                         "parallelism without it")
    if plan is not None:
        for block in blocks:
            parallelize_module(block, mesh, {path: STYLES[style]() for path, style in plan.items()})
        return
    for block in blocks:
        heads = block.attn.n_heads
        if heads % tp:
            raise ValueError(f"{heads} attention heads do not split over {tp} ranks")
        styles = block_plan(block)
        if sequence_parallel:
            styles = {**styles, **sequence_block_plan(block, styles)}
        parallelize_module(block, mesh, styles)
        # Each rank now projects to its own heads only.
        block.attn.n_heads = heads // tp
