"""Placement: map a job's ranks onto free GPUs. Pure, deterministic, no Ray.

Rank order follows the parallel layout, tensor-parallel fastest:
rank = (dp_index * pp + pp_index) * tp + tp_index. Each tensor-parallel group
must fit inside one NVLink island (hard rule). Groups are placed best-fit
(the island left with the fewest free GPUs) while preferring the node and
leaf the previous group used, so pipelines and DP rings stay close.
"""

from __future__ import annotations

from dataclasses import dataclass

from kuangchao.platform.topology import NodeInfo


@dataclass(frozen=True)
class JobShape:
    dp: int
    tp: int = 1
    pp: int = 1
    gpus_per_rank: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


@dataclass(frozen=True)
class RankSlot:
    rank: int
    node: str
    node_id: str
    leaf: str
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class PlacementPlan:
    slots: tuple[RankSlot, ...]


@dataclass(frozen=True)
class Infeasible:
    reason: str


def free_gpus(nodes: tuple[NodeInfo, ...], used: dict[str, set[int]]) -> dict[str, list[int]]:
    """Free GPU ids per live node name, given the ids in use."""
    return {n.name: [g for g in range(n.gpus) if g not in used.get(n.name, set())]
            for n in nodes if n.alive}


def place(nodes: tuple[NodeInfo, ...], used: dict[str, set[int]],
          shape: JobShape) -> PlacementPlan | Infeasible:
    """Place every rank of `shape`, or explain why not.

    Args:
        nodes: The cluster's nodes.
        used: GPU ids already taken, by node name.
        shape: The job's parallel layout.

    Returns:
        A plan with one slot per rank in rank order, or `Infeasible` with a
        reason that names the capacity that is missing.
    """
    free = free_gpus(nodes, used)
    total_free = sum(len(v) for v in free.values())
    need = shape.world_size * shape.gpus_per_rank
    if shape.gpus_per_rank == 0:
        return _place_cpu_only(nodes, shape)
    total = sum(n.gpus for n in nodes if n.alive)
    if need > total:
        return Infeasible(f"needs {need} GPUs, the cluster has {total}")
    if need > total_free:
        return Infeasible(f"needs {need} GPUs, {total_free} of {total} are free")
    group_gpus = shape.tp * shape.gpus_per_rank
    by_name = {n.name: n for n in nodes}
    free_sets = {name: set(ids) for name, ids in free.items()}
    slots: list[RankSlot] = []
    prev: NodeInfo | None = None
    for g in range(shape.dp * shape.pp):
        choice = _pick_island(nodes, free_sets, group_gpus, prev)
        if choice is None:
            return Infeasible(
                f"no NVLink island has {group_gpus} free GPUs for tensor-parallel group {g}"
                f" (tp={shape.tp}); {total_free} GPUs are free but fragmented"
            )
        node_name, ids = choice
        free_sets[node_name] -= set(ids)
        node = by_name[node_name]
        for t in range(shape.tp):
            rank_ids = tuple(ids[t * shape.gpus_per_rank:(t + 1) * shape.gpus_per_rank])
            slots.append(RankSlot(rank=g * shape.tp + t, node=node.name, node_id=node.node_id,
                                  leaf=node.leaf, gpus=rank_ids))
        prev = node
    return PlacementPlan(slots=tuple(slots))


def _pick_island(nodes: tuple[NodeInfo, ...], free: dict[str, set[int]], k: int,
                 prev: NodeInfo | None) -> tuple[str, list[int]] | None:
    best: tuple[tuple, str, list[int]] | None = None
    for n in nodes:
        if not n.alive:
            continue
        for isl in n.islands:
            avail = sorted(g for g in isl if g in free.get(n.name, ()))
            if len(avail) < k:
                continue
            # Prefer the previous node, then its leaf; then best fit; then name.
            key = (
                0 if prev is not None and n.name == prev.name else 1,
                0 if prev is not None and n.leaf == prev.leaf else 1,
                len(avail) - k,
                len(free.get(n.name, ())),
                n.name,
                isl[0],
            )
            if best is None or key < best[0]:
                best = (key, n.name, avail[:k])
    return None if best is None else (best[1], best[2])


def _place_cpu_only(nodes: tuple[NodeInfo, ...], shape: JobShape) -> PlacementPlan | Infeasible:
    live = [n for n in nodes if n.alive]
    if not live:
        return Infeasible("no live nodes")
    slots = tuple(RankSlot(rank=r, node=live[r % len(live)].name, node_id=live[r % len(live)].node_id,
                           leaf=live[r % len(live)].leaf, gpus=()) for r in range(shape.world_size))
    return PlacementPlan(slots=slots)
