"""The engine's side of a mixture of experts: groups, gradients and norms per layout.

workers/parallel/expert_parallel.py moves tokens inside a forward; this wires it
into a rank's engine (workers/parallel/engine.py): which experts the rank keeps,
the groups its MoE layers talk over, the auxiliary losses' gradient scale each
step, where gradients are reduced, how the gradient norm counts experts held
elsewhere, and FSDP2's sharding of experts under ZeRO 2 and 3.

A dense model gets no wiring (`wire_experts` returns None) and the engine runs
exactly as it did before mixtures of experts existed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kuangchao.workers.errors import TrainingError
from kuangchao.workers.parallel.expert_parallel import ExpertComm

EXPERTS = ".experts."  # in the name of every expert parameter: blocks.3.moe.experts.5.up_proj.weight


def moe_layers(chunks: list[nn.Module]) -> list[nn.Module]:
    return [m for c in chunks for m in c.modules() if getattr(m, "is_moe_layer", False)]


def is_expert(name: str) -> bool:
    return EXPERTS in f".{name}"


class ExpertWiring:
    """One rank's mixture-of-experts wiring; made by `wire_experts`.

    Args:
        layers: The MoE layers this rank runs.
        comm: What they move tokens with.
        ep: Expert-parallel size.
        ep_group, edp_group: Its expert-parallel group, and the ranks holding
            the same experts (None when that is this rank alone).
    """

    def __init__(self, layers: list[nn.Module], comm: ExpertComm, ep: int,
                 ep_group: dist.ProcessGroup | None, edp_group: dist.ProcessGroup | None) -> None:
        self.layers, self.comm, self.ep = layers, comm, ep
        self.ep_group, self.edp_group = ep_group, edp_group
        self.state = layers[0].state

    def begin_step(self, engine: Any, microbatches: int) -> None:
        """Reset the step's statistics; scale the auxiliary losses' gradients as the LM
        loss's: divided by the micro-batches when they accumulate (a pipeline schedule
        divides every gradient by them itself).

        Raises:
            TrainingError: Uneven data-parallel shares, which validation refuses for a
                mixture of experts (capacity needs every rank on the same micro-batches).
        """
        if engine.shares is not None:
            raise TrainingError("resources.balance: a mixture of experts needs even data-"
                                "parallel shares; set balance: even")
        self.state.reset()
        self.state.window = microbatches * len(self.layers)
        pipelined = engine.schedule is not None
        self.state.grad_scale = engine.loss_factor if pipelined else 1.0 / microbatches

    def collectives(self) -> set[str]:
        out = {"all_gather"} if self.comm.dp_size > 1 else set()
        if self.ep > 1:
            out |= {"all_to_all", "all_reduce"}
        return out

    def allreduce_grads(self, holder: nn.Module, dp_group: dist.ProcessGroup | None,
                        dp: int) -> None:
        """Average the gradients as one process on the global batch would have them: the
        dense ones over the data-parallel group, each expert's over the ranks holding it
        (its holder already summed the gradients of the tokens it served for its EP group)."""
        dense, experts = [], []
        for name, param in holder.named_parameters():
            if param.grad is not None:
                (experts if self.ep > 1 and is_expert(name) else dense).append(param.grad)
        _flat_allreduce(dense, dp_group, dp)
        _flat_allreduce(experts, self.edp_group, dp)

    def other_experts_sq(self, holder: nn.Module, device: torch.device) -> torch.Tensor:
        """The squared gradient norm of the experts the other ranks of this rank's EP group
        hold (0 without EP), to add to this rank's own."""
        sq = torch.zeros((), dtype=torch.float64, device=device)
        if self.ep == 1:
            return sq
        for name, param in holder.named_parameters():
            if param.grad is None or not is_expert(name):
                continue
            norm = torch.linalg.vector_norm(param.grad, dtype=torch.float32)
            if hasattr(norm, "full_tensor"):
                norm = norm.full_tensor()
            sq += norm.double() ** 2
        total = sq.clone()
        dist.all_reduce(total, group=self.ep_group)
        return total - sq


def shard_experts(block: nn.Module, mesh: Any, kwargs: dict[str, Any]) -> None:
    """ZeRO 2 and 3 with EP: FSDP2 over each expert `block` holds, sharded over the ranks
    holding it (the mesh's edp dimension), its gradients summed there and divided by dp as
    `ExpertWiring.allreduce_grads` does by hand; the caller then shards the rest over dp.
    Nothing without EP (no edp dimension): the experts shard with the block."""
    from torch.distributed.fsdp import fully_shard

    if mesh is None or "edp" not in (mesh.mesh_dim_names or ()):
        return
    for layer in moe_layers([block]):
        for expert in layer.experts.values():
            fully_shard(expert, **{**kwargs, "mesh": mesh["edp"]})
            expert.set_gradient_divide_factor(float(mesh["dp"].size()))
            # Gloo has no pre-scaled sum: sum on the wire, divide after. (A one-rank group
            # divides by the factor with no collective, and must not divide again.)
            if mesh["edp"].size() > 1:
                expert.set_force_sum_reduction_for_comms(True)


def _flat_allreduce(grads: list[torch.Tensor], group: dist.ProcessGroup | None,
                    divisor: int) -> None:
    """Sum `grads` over `group` (None: nothing to sum with) in one flat buffer, then divide."""
    if not grads:
        return
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    flat = torch._utils._flatten_dense_tensors(local)
    if group is not None:
        dist.all_reduce(flat, group=group)
    flat.div_(divisor)
    for g, synced in zip(local, torch._utils._unflatten_dense_tensors(flat, local), strict=True):
        g.copy_(synced)


def wire_experts(engine: Any) -> ExpertWiring | None:
    """Wire the MoE layers of `engine.chunks` for its layout; None for a dense model.

    With EP the rank keeps only its experts (EP index j of ep: the j-th run of
    n_experts / ep), under their global names. Collective where distributed (the
    groups are the engine's mesh's)."""
    layers = moe_layers(engine.chunks)
    if not layers:
        return None
    lay, mesh = engine.layout, engine.mesh
    if not engine.distributed:
        return ExpertWiring(layers, ExpertComm.single(), 1, None, None)
    if mesh is None:  # plain data parallelism (a live resize may change the group)
        comm = ExpertComm.world()
        for layer in layers:
            layer.comm = comm
        return ExpertWiring(layers, comm, 1, None, None)
    ep_group = mesh.get_group("ep") if lay.ep > 1 else None
    edp_group = mesh.get_group("edp") if lay.ep > 1 and lay.dp > lay.ep else None
    comm = ExpertComm(engine.dp_group, engine.coords.dp, lay.dp, ep_group, lay.ep)
    j = engine.coords.dp % lay.ep
    for layer in layers:
        layer.comm = comm
        per = layer.n_experts // lay.ep
        for name in list(layer.experts):
            if not j * per <= int(name) < (j + 1) * per:
                del layer.experts[name]
    return ExpertWiring(layers, comm, lay.ep, ep_group, edp_group)


def count_globally(model: nn.Module, mesh: Any, dp_rank: int) -> None:
    """`ctx.prepare_model` on a mixture of experts: its layers gather the routing counts
    over the data-parallel group (the default group without a mesh), so capacity is
    global as under the built-in trainer. Experts stay on every rank (no EP there)."""
    layers = moe_layers([model])
    if not layers:
        return
    if mesh is None:
        comm = ExpertComm.world()
    else:
        comm = ExpertComm(mesh.get_group("dp"), dp_rank, mesh["dp"].size(), None, 1)
    for layer in layers:
        layer.comm = comm
