"""How good a placement is: the traffic it sends across islands and leaves.

A pure estimate from the plan, the topology and the model size, used by
`kc place`, the placement benchmark and (later) to compare candidate plans.
Traffic per optimizer step:

* data parallel: a ring all-reduce of each rank's gradient shard; each ring
  edge carries about `2 * (dp - 1) / dp * grad_bytes / (tp * pp)`;
* pipeline parallel: activations forward and gradients backward across every
  stage boundary, `2 * micro_batch * seq_len * d_model * 4` bytes per
  micro-batch.

Tensor-parallel traffic stays inside NVLink islands by construction (a split
TP group is counted separately, and should never happen).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.placement.solver import JobShape, PlacementPlan, Traffic


@dataclass(frozen=True)
class PlacementScore:
    tp_groups_split: int
    pipelines_across_leaves: int
    leaves_used: int
    nodes_used: int
    cross_leaf_ring_edges: int
    cross_island_bytes: float
    cross_leaf_bytes: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _island_of(node: NodeInfo, gpu: int) -> int:
    for i, isl in enumerate(node.islands):
        if gpu in isl:
            return i
    return -1


def score(plan: PlacementPlan, nodes: tuple[NodeInfo, ...], shape: JobShape,
          traffic: Traffic = Traffic()) -> PlacementScore:
    """Score a plan. Ranks must be in plan order (rank i at `plan.slots[i]`)."""
    by_name = {n.name: n for n in nodes}
    where = [(s.node, s.leaf, _island_of(by_name[s.node], s.gpus[0]) if s.gpus else -1)
             for s in plan.slots]
    tp, pp, dp = shape.tp, shape.pp, shape.dp

    def rank(d: int, s: int, t: int) -> int:
        return (d * pp + s) * tp + t

    split = sum(1 for g in range(dp * pp)
                if len({where[g * tp + t][0::2] for t in range(tp)}) > 1)
    pipes_across = sum(1 for d in range(dp)
                       if len({where[rank(d, s, 0)][1] for s in range(pp)}) > 1)
    ring_edges = cross_island_ring = 0
    if dp > 1:
        for s in range(pp):
            for t in range(tp):
                for d in range(dp):
                    a, b = where[rank(d, s, t)], where[rank((d + 1) % dp, s, t)]
                    ring_edges += a[1] != b[1]
                    cross_island_ring += a[0::2] != b[0::2]
    pp_leaf = pp_island = 0
    for d in range(dp):
        for s in range(pp - 1):
            for t in range(tp):
                a, b = where[rank(d, s, t)], where[rank(d, s + 1, t)]
                pp_leaf += a[1] != b[1]
                pp_island += a[0::2] != b[0::2]
    ring_bytes = 2 * (dp - 1) / dp * traffic.grad_bytes / (tp * pp) if dp > 1 else 0.0
    return PlacementScore(
        tp_groups_split=split, pipelines_across_leaves=pipes_across,
        leaves_used=len({w[1] for w in where}), nodes_used=len({w[0] for w in where}),
        cross_leaf_ring_edges=ring_edges,
        cross_island_bytes=cross_island_ring * ring_bytes + pp_island * traffic.activation_bytes,
        cross_leaf_bytes=ring_edges * ring_bytes + pp_leaf * traffic.activation_bytes,
    )
