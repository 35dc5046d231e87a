"""Megatron-style tensor parallelism for the built-in models, with DTensor.

In every block, attention's q/k/v projections and the MLP's up (and gate)
projections are split by output column, each rank computing its share of the
heads and hidden units; attention's output projection and the MLP's down
projection are split by input row, and their outputs are summed over the
group. That is one all-reduce after attention and one after the MLP in the
forward pass, and one each in backward. Embeddings, norms and the head stay
whole on every rank of the group.

A Hugging Face model brings its own plan (its config's `base_model_tp_plan`,
or the one kc keeps for its family: platform/spec/model.py), by submodule path
inside a decoder layer. Its attention reshapes with `-1` heads, so it needs no
head count changed.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def block_plan(block: nn.Module) -> dict[str, ColwiseParallel | RowwiseParallel]:
    """The column/row split of one block's projections, by submodule path."""
    plan: dict[str, ColwiseParallel | RowwiseParallel] = {
        "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(),
        "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
    }
    if hasattr(block.mlp, "gate_proj"):  # Llama's SwiGLU
        plan["mlp.gate_proj"] = ColwiseParallel()
    return plan


STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def apply_tensor_parallel(blocks: list[nn.Module], mesh: DeviceMesh,
                          plan: dict[str, str] | None = None) -> None:
    """Split each block over the 1-D tensor-parallel `mesh`, in place.

    `plan`: a Hugging Face model's, submodule path -> "colwise" | "rowwise";
    None: the built-in models' (`block_plan`)."""
    tp = mesh.size()
    if plan is not None:
        for block in blocks:
            parallelize_module(block, mesh, {path: STYLES[style]() for path, style in plan.items()})
        return
    for block in blocks:
        heads = block.attn.n_heads
        if heads % tp:
            raise ValueError(f"{heads} attention heads do not split over {tp} ranks")
        parallelize_module(block, mesh, block_plan(block))
        # Each rank now projects to its own heads only.
        block.attn.n_heads = heads // tp
