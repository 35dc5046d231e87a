"""Mixture of experts in the cost model: what the experts and expert parallelism add.

Pure (stdlib only). `cost.py` asks these for a MoE model (`ModelShape.is_moe`);
a dense model never reaches them, so its plans are what they were.

Expert parallelism (`expert_parallel_size`, ep) splits each block's
`n_experts` experts over ep of the data-parallel replicas: a rank holds
n_experts / ep experts (split over its TP group like the dense MLP), the
attention, norms, router and embeddings as a dense model does. The replicas
holding the same experts, dp / ep of them, keep those in sync (and shard their
states under ZeRO); the dense part syncs over all dp.

Capacity is global (workers/models/router.py): each MoE block's forward first
all-gathers every data-parallel rank's per-expert counts, a small collective
whose latency is paid per block, micro-batch and forward, with or without EP.
Per MoE block and micro-batch, the dispatch and the combine are each one
`all_to_all` over the EP group, forward and again in backward (4; 6 with full
recompute, which runs the forward twice). Each moves the rank's tokens' top_k
copies of a d_model activation in bf16, all but the 1/ep that stay local:
`tokens x top_k x d_model x 2 x (ep-1)/ep` bytes, at the slowest link the group
crosses (comm.py), on the compute stream: exposed. The tokens are the rank's
micro-batch (b x seq_len); with sequence parallelism each TP rank sends only
its 1/tp of the sequence, without it every TP rank sends the whole, as each
holds it.

The busiest rank's experts set the pace: a router balanced on average still
sends some experts more tokens, and the capacity factor caps an expert at
`capacity_factor` x the mean. The rank holding n_experts / ep experts at that
cap computes up to `min(capacity_factor, ep)` x the mean share (it cannot
receive more than every token), and the others wait for it: `imbalance`
multiplies the experts' FLOPs (and their activations) by that. Without a cap
(capacity_factor None: a dropless router) the bound is ep. With ep = 1 each
rank runs every expert on its own tokens: no wait beyond the mean.
"""

from __future__ import annotations

from kuangchao.platform.cluster.hardware import Accelerator
from kuangchao.platform.planning.comm import collective
from kuangchao.platform.planning.shapes import ModelShape

BF16 = 2
# All-to-alls per MoE block per micro-batch: dispatch and combine, forward and backward.
A2A_PER_LAYER = 4
A2A_PER_LAYER_RECOMPUTE = 6


def imbalance(capacity_factor: float | None, ep: int) -> float:
    """How many times the mean expert work per rank the busiest rank does (see the module)."""
    if ep <= 1:
        return 1.0 if capacity_factor is None else min(1.0, capacity_factor)
    return float(ep) if capacity_factor is None else min(float(capacity_factor), float(ep))


def routing_summary_bytes(model: ModelShape) -> int:
    """One rank's routing summary each MoE block all-gathers over dp before it can apply
    the global capacity (workers/models/router.py `summary`): 2E + 2 float64."""
    return 8 * (2 * (model.n_experts or 0) + 2)


def all_to_all_bytes(tokens: float, top_k: int, d_model: int, ep: int, value_bytes: int = BF16) -> float:
    """Bytes one rank puts on the wire in one dispatch (or combine): its tokens' top_k
    copies, less the 1/ep routed to experts it holds itself."""
    if ep <= 1:
        return 0.0
    return tokens * top_k * d_model * value_bytes * (ep - 1) / ep


def all_to_all_seconds(tokens: float, model: ModelShape, ep: int, per_node: int,
                       acc: Accelerator) -> float:
    """One dispatch (or combine) all_to_all over an EP group with `per_node` members a node."""
    return collective("all_to_all", tokens * model.top_k * model.d_model * BF16, ep, per_node, acc)


def expert_options(model: ModelShape, dp: int) -> list[int]:
    """EP sizes a layout with `dp` replicas may use: divisors of dp that divide n_experts.
    Only the built-in MoE model (arch "moe") has expert parallelism; a Hugging Face
    MoE model runs whole, its experts costed on every rank."""
    if model.arch != "moe" or not model.is_moe:
        return [1]
    n = model.n_experts or 1
    return [e for e in range(1, min(dp, n) + 1) if dp % e == 0 and n % e == 0]


def activation_terms(model: ModelShape, imb: float) -> tuple[float, float]:
    """Bytes per token of one MoE block's activations (Korthikanti et al. 2022, Eq. 2's
    accounting, the attention scores left out as in cost.py), split as cost.py does into
    the TP-replicated and the TP-sharded part.

    The dense MLP's input (2h) gives way to the top_k dispatched copies and the top_k
    expert outputs awaiting the combine (2h each, bf16); each copy passes through a
    SwiGLU expert, whose f-wide tensors (gate and up outputs, their product) are 6f.
    The busiest rank holds `imb` x the mean of both. The router's fp32 logits and
    probabilities add 8 bytes per expert."""
    h, f, k = model.d_model, model.ffn, model.top_k
    replicated = 8 * h + 4 * k * imb * h + 8 * (model.n_experts or 0)
    sharded = 8 * h + 6 * f * k * imb
    return replicated, sharded
