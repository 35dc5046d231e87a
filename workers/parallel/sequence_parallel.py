"""Megatron-style sequence parallelism inside the tensor-parallel group, with DTensor.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv:2205.05198). Plain tensor parallelism keeps the residual stream,
the norms and the dropouts whole on every rank of the group: their activations
are stored `tp` times over. Here they are split along the sequence: between the
tensor-parallel regions each rank holds tokens [r*T/tp, (r+1)*T/tp) of every
sequence, [B, T/tp, D].

Per block `attn_norm -> attn -> mlp_norm -> mlp` (the built-in models' shape; a
mixture of experts has `moe` in place of `mlp`):

* each norm runs on its rank's shard (`SequenceParallel`; its weight becomes a
  replicated DTensor whose gradient is a partial sum over the shards, summed
  once after backward: `reduce_partial_grads`);
* entering attention and the MLP, the shards are all-gathered (one all-gather
  for q, k and v together) and, in backward, their gradients reduce-scattered;
  autograd keeps the gathered input as the shard and gathers it again in
  backward (workers/parallel/regather.py), as Megatron does;
* the row-parallel output projections (`o_proj`, `down_proj`) reduce-scatter to
  sequence shards instead of all-reducing, and their dropouts run on the shard,
  with masks of the rank's own (`own_masks`); in backward the gradient is
  all-gathered.

So each all-reduce of plain tensor parallelism becomes an all-gather plus a
reduce-scatter, the same bytes on a ring. A branch whose projections tensor
parallelism does not split as above (a mixture-of-experts layer, say) gets the
whole sequence, as it would without sequence parallelism, and its output is
cut back to the shard.

At the model's ends (`wire_sequence_parallel`): the embedding (and GPT's learned
positions, added over the whole sequence) is cut to the shard at the
embedding dropout; the final norm runs on the shard, and the head gets the
whole sequence, so every rank computes the same logits and loss as before.
Pipeline stages send their shards: a stage's input is already split, and its
rotary tables cover tp times its input's length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from kuangchao.workers.errors import ModelInputError
from kuangchao.workers.parallel.regather import gathering

SEQ = 1  # the sequence dimension of the [B, T, D] activations
NORMS = ("attn_norm", "mlp_norm")
# The module each norm feeds: attention, then the MLP (or a mixture of experts' `moe`).
BRANCHES = ("attn", "mlp", "moe")
# A branch whose last projection is this row-parallel Linear ends in a reduce-scatter.
BRANCH_OUTPUTS = {"attn": "attn.o_proj", "mlp": "mlp.down_proj"}


def dense_branches(tp_plan: dict[str, ParallelStyle]) -> list[str]:
    """The branches of a block that tensor parallelism splits Megatron's way: their
    last projection, named in BRANCH_OUTPUTS, is row-parallel."""
    return [b for b, out in BRANCH_OUTPUTS.items() if isinstance(tp_plan.get(out), RowwiseParallel)]


def sequence_block_plan(block: nn.Module, tp_plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """What sequence parallelism adds to (or changes in) a block's tensor-parallel plan."""
    missing = [n for n in NORMS if not hasattr(block, n)]
    if missing:
        raise ValueError(f"sequence parallelism needs blocks of the shape attn_norm -> attn -> "
                         f"mlp_norm -> mlp; {type(block).__name__} has no {', '.join(missing)}")
    plan: dict[str, ParallelStyle] = {n: SequenceParallel(sequence_dim=SEQ) for n in NORMS}
    for branch in dense_branches(tp_plan):
        plan[BRANCH_OUTPUTS[branch]] = RowwiseParallel(output_layouts=Shard(SEQ))
    return plan


def _as_shards(x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """`x` as the DTensor of sequence shards it is (a norm's output is one already)."""
    if isinstance(x, DTensor):
        return x
    return DTensor.from_local(x, mesh, (Shard(SEQ),), run_check=False)


def gather(x: torch.Tensor, mesh: DeviceMesh, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather sequence shards into the whole sequence; (whole, this rank's shard).

    `local` False: a replicated DTensor, for column-parallel projections, whose
    input gradients come back as partial sums and are reduce-scattered once.
    True: a plain tensor whose gradient is taken as whole on every rank (what a
    module gives its input under plain tensor parallelism), so backward keeps
    this rank's slice of it."""
    shard = _as_shards(x, mesh)
    whole = shard.redistribute(mesh, (Replicate(),))
    return (whole.to_local() if local else whole), shard.to_local()


def scatter(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's sequence shard of a tensor that is whole and the same on every rank;
    in backward the shards' gradients are all-gathered."""
    tp = mesh.size()
    if x.size(SEQ) % tp:
        raise ModelInputError(f"parallel.sequence_parallel: a sequence of {x.size(SEQ)} tokens "
                              f"does not split into {tp} equal shards; use batches of "
                              f"model.seq_len tokens, a multiple of tensor_parallel_size")
    whole = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
    return whole.redistribute(mesh, (Shard(SEQ),)).to_local()


def _is_dense(block: nn.Module, branch: str) -> bool:
    """Whether the branch ends in a row-parallel projection (`sequence_block_plan` made
    its output sequence shards)."""
    try:
        out = block.get_submodule(BRANCH_OUTPUTS[branch])
    except AttributeError:
        return False
    weight = getattr(out, "weight", None)
    return isinstance(weight, DTensor) and weight.placements == (Shard(1),)


def wire_block(block: nn.Module, mesh: DeviceMesh, keep_shards: bool) -> None:
    """Feed each branch the whole sequence, gathered from the shards; a branch not split
    Megatron's way gets it as a plain tensor, and its whole output is cut back to the
    shard. Call after `parallelize_module` with `sequence_block_plan`'s styles.
    `keep_shards`: autograd keeps the gathered inputs as shards (workers/parallel/regather.py);
    False when the block is recomputed anyway."""
    for branch in BRANCHES:
        module = getattr(block, branch, None)
        if module is None:
            continue
        dense = branch in BRANCH_OUTPUTS and _is_dense(block, branch)
        forward = module.forward
        if not dense:
            forward = _scattering(forward, mesh)
        module.forward = gathering(forward, lambda x, d=dense: gather(x, mesh, not d), mesh, SEQ,
                                   keep_shards)


def _scattering(forward: Callable[..., Any], mesh: DeviceMesh) -> Callable[..., Any]:
    """`forward` with its output (the first item of a tuple) cut to this rank's shard."""
    def run(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        if isinstance(out, tuple):
            return (scatter(out[0], mesh), *out[1:])
        return scatter(out, mesh)
    return run


def own_masks(dropout: nn.Dropout, rank: int) -> None:
    """Give `dropout`, which runs on this rank's sequence shard, masks of its own.

    The ranks of a tensor-parallel group draw the same random numbers (plain tensor
    parallelism needs that: a dropout on a replicated tensor must drop the same
    entries everywhere), so every shard would get the same mask pattern. As
    Megatron forks a per-rank generator there, each call draws one seed from the
    shared generator (advancing it alike on every rank), runs the dropout from that
    seed plus the rank, and puts the generator back. Recomputation replays it: it
    restores the shared generator first."""
    forward = dropout.forward

    def run(x: torch.Tensor) -> torch.Tensor:
        if not dropout.training or dropout.p == 0:
            return forward(x)
        seed = int(torch.randint(0, 2**62, (1,)))
        gen = torch.cuda.default_generators[x.device.index or 0] if x.is_cuda else torch.default_generator
        state = gen.get_state()
        gen.manual_seed(seed + rank)
        try:
            return forward(x)
        finally:
            gen.set_state(state)
    dropout.forward = run


def wire_sequence_parallel(chunks: list[nn.Module], mesh: DeviceMesh) -> None:
    """Wire the gathers of every block (`wire_block`) and the model's ends on each
    pipeline chunk: the embedding's output is cut to the shard (at the embedding
    dropout, after GPT's positions are added), the final norm runs on the shard and
    the head gets the whole sequence. The dropout modules (the embedding's, and in
    the built-in blocks every one, all on the residual stream) draw masks of their
    own per rank (`own_masks`)."""
    rank = mesh.get_local_rank()
    for chunk in chunks:
        keep = not chunk.recompute
        for block in chunk.blocks.values():
            wire_block(block, mesh, keep)
            for module in block.modules():
                if isinstance(module, nn.Dropout):
                    own_masks(module, rank)
        chunk.seq_shards = mesh.size()  # a stage's input is a shard: its rotary tables are longer
        if chunk.first:
            chunk.drop.register_forward_pre_hook(lambda _, args: (scatter(args[0], mesh), *args[1:]))
            own_masks(chunk.drop, rank)
        if chunk.last:
            parallelize_module(chunk.norm, mesh, SequenceParallel(sequence_dim=SEQ))
            chunk.lm_head.forward = gathering(chunk.lm_head.forward, lambda x: gather(x, mesh, True),
                                              mesh, SEQ, keep_shards=True)


@torch.no_grad()
def reduce_partial_grads(module: nn.Module) -> None:
    """Sum the sequence-parallel norms' gradients over their shards, in one all-reduce.

    A replicated weight applied to sequence shards gets a partial gradient on each
    rank. Summed here once a step (after the last micro-batch's backward), the
    optimizer and the gradient norm read plain replicated gradients; FSDP2 sums
    them itself, and leaves none partial."""
    partial: dict[Any, list[nn.Parameter]] = {}
    for p in dict.fromkeys(module.parameters()):
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            partial.setdefault((g.device_mesh, g.placements), []).append(p)
    for (grad_mesh, placements), params in partial.items():
        if placements != (Partial("sum"),):  # never in the layouts wired here: the general path
            for p in params:
                p.grad = p.grad.redistribute(grad_mesh, p.placements)
            continue
        local = [p.grad.to_local() for p in params]
        flat = torch._utils._flatten_dense_tensors(local)
        dist.all_reduce(flat, group=grad_mesh.get_group())
        for p, summed in zip(params, torch._utils._unflatten_dense_tensors(flat, local), strict=True):
            p.grad = DTensor.from_local(summed, grad_mesh, p.placements, run_check=False)
