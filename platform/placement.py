"""Placement: map a job's ranks onto free GPUs. Pure, deterministic, no Ray.

Rank order follows the parallel layout, tensor-parallel fastest:
`rank = (dp_index * pp + stage) * tp + tp_index`, so data-parallel replica i
(one pipeline) holds ranks `[i*pp*tp, (i+1)*pp*tp)`.

Rules, from hard to soft:

1. every tensor-parallel group sits inside one NVLink island (hard); a single
   rank (tp=1) with more GPUs than an island needs one node;
2. every pipeline sits inside one leaf switch when capacity allows;
3. the data-parallel rings cross as few leaves as possible: replicas are
   packed into the fewest leaves (under one spine when possible) and laid out
   leaf by leaf, so a ring changes leaf only once per leaf it spans;
4. best fit: the tightest leaf, node and island that fits is used first, so
   the free capacity left behind stays in large, usable blocks.
"""

from __future__ import annotations

from collections import defaultdict
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

    @property
    def group_gpus(self) -> int:
        """GPUs one tensor-parallel group needs inside one island."""
        return self.tp * self.gpus_per_rank


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


@dataclass(frozen=True)
class _GroupSlot:
    """Room for one tensor-parallel group: GPU ids inside one island of one node."""

    node: NodeInfo
    gpus: tuple[int, ...]


def free_gpus(nodes: tuple[NodeInfo, ...], used: dict[str, set[int]]) -> dict[str, list[int]]:
    """Free GPU ids per live node name, given the ids in use."""
    return {n.name: [g for g in range(n.gpus) if g not in used.get(n.name, set())]
            for n in nodes if n.alive}


def _node_group_slots(node: NodeInfo, free: set[int], k: int, tp: int) -> list[_GroupSlot]:
    # Tightest islands first: a group that exactly fills an island leaves no scrap.
    islands = sorted(((sorted(g for g in isl if g in free), isl[0]) for isl in node.islands),
                     key=lambda x: (len(x[0]), x[1]))
    if tp == 1 and all(len(isl) < k for isl in node.islands):
        # One rank with more GPUs than an island: it needs one node, not one island.
        avail = [g for ids, _ in islands for g in ids]
        return [_GroupSlot(node, tuple(sorted(avail[j * k:(j + 1) * k])))
                for j in range(len(avail) // k)]
    out = []
    for avail, _ in islands:
        out += [_GroupSlot(node, tuple(avail[j * k:(j + 1) * k])) for j in range(len(avail) // k)]
    return out


def _leaf_slots(nodes: tuple[NodeInfo, ...], used: dict[str, set[int]], free_n: dict[str, int],
                k: int, tp: int) -> dict[str, list[_GroupSlot]]:
    by_leaf: dict[str, list[_GroupSlot]] = defaultdict(list)
    # Best fit across nodes: the node with the fewest free GPUs is filled first.
    # Nodes with fewer than k free GPUs can hold no group; skip them early,
    # which keeps a solve on a large, busy cluster cheap.
    for node in sorted((n for n in nodes if free_n[n.name] >= k),
                       key=lambda n: (free_n[n.name], n.name)):
        free = set(range(node.gpus)) - used.get(node.name, set())
        by_leaf[node.leaf] += _node_group_slots(node, free, k, tp)
    return by_leaf


def _cover(leaves: list[str], cap: dict[str, int], need: int) -> list[str] | None:
    """Fewest leaves whose capacities add up to `need`; the last one best-fit."""
    order = sorted((lf for lf in leaves if cap[lf] > 0), key=lambda lf: (-cap[lf], lf))
    chosen: list[str] = []
    got = 0
    for leaf in order:
        rest = need - got
        fitting = [lf for lf in order if lf not in chosen and cap[lf] >= rest]
        if fitting:
            return chosen + [min(fitting, key=lambda lf: (cap[lf], lf))]
        chosen.append(leaf)
        got += cap[leaf]
    return None


def _choose_leaves(cap: dict[str, int], need: int, spine: dict[str, str | None]) -> list[str] | None:
    by_spine: dict[str | None, list[str]] = defaultdict(list)
    for leaf in cap:
        by_spine[spine.get(leaf)].append(leaf)
    options = []
    for sp, leaves in by_spine.items():
        sel = _cover(leaves, cap, need)
        if sel is not None:
            options.append((len(sel), sum(cap[lf] for lf in sel) - need, str(sp), sel))
    if options:
        return min(options)[3]
    return _cover(list(cap), cap, need)


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
    if shape.gpus_per_rank == 0:
        return _place_cpu_only(nodes, shape)
    live = tuple(n for n in nodes if n.alive)
    free_n = {n.name: n.gpus - len(used.get(n.name, ())) for n in live}
    total = sum(n.gpus for n in live)
    total_free = sum(free_n.values())
    need = shape.world_size * shape.gpus_per_rank
    if need > total:
        return Infeasible(f"needs {need} GPUs, the cluster has {total}")
    if need > total_free:
        return Infeasible(f"needs {need} GPUs, {total_free} of {total} are free")
    k = shape.group_gpus
    if shape.tp > 1:
        largest = max((len(isl) for n in live for isl in n.islands), default=0)
        if k > largest:
            return Infeasible(f"a tensor-parallel group needs {k} GPUs in one NVLink island; "
                              f"the largest island has {largest}")
    elif k > max(n.gpus for n in live):
        return Infeasible(f"a rank needs {k} GPUs on one node; the largest node has "
                          f"{max(n.gpus for n in live)}")
    slots = _leaf_slots(live, used, free_n, k, shape.tp)
    groups = shape.dp * shape.pp
    n_slots = sum(len(s) for s in slots.values())
    if n_slots < groups:
        return Infeasible(f"needs {groups} groups of {k} GPUs inside one NVLink island; only "
                          f"{n_slots} are free ({total_free} GPUs free but fragmented)")
    spine = {n.leaf: n.spine for n in live}
    cap = {leaf: len(s) // shape.pp for leaf, s in slots.items()}
    leaves = _choose_leaves(cap, shape.dp, spine)
    if leaves is not None:
        chosen = _pipelines_within_leaves(slots, sorted(leaves), shape)
    else:  # pipelines must straddle leaves: take slots leaf by leaf, fullest first
        order = sorted(slots, key=lambda lf: (-len(slots[lf]), lf))
        chosen = [s for lf in order for s in slots[lf]][:groups]
    return PlacementPlan(slots=tuple(_ranks(chosen, shape)))


def _pipelines_within_leaves(slots: dict[str, list[_GroupSlot]], leaves: list[str],
                             shape: JobShape) -> list[_GroupSlot]:
    out: list[_GroupSlot] = []
    remaining = shape.dp
    for leaf in leaves:
        take = min(remaining, len(slots[leaf]) // shape.pp)
        out += slots[leaf][:take * shape.pp]
        remaining -= take
    return out


def _ranks(groups: list[_GroupSlot], shape: JobShape) -> list[RankSlot]:
    out = []
    g = shape.gpus_per_rank
    for gi, slot in enumerate(groups):
        for t in range(shape.tp):
            out.append(RankSlot(rank=gi * shape.tp + t, node=slot.node.name,
                                node_id=slot.node.node_id, leaf=slot.node.leaf,
                                gpus=slot.gpus[t * g:(t + 1) * g]))
    return out


def _place_cpu_only(nodes: tuple[NodeInfo, ...], shape: JobShape) -> PlacementPlan | Infeasible:
    live = [n for n in nodes if n.alive]
    if not live:
        return Infeasible("no live nodes")
    slots = tuple(RankSlot(rank=r, node=live[r % len(live)].name, node_id=live[r % len(live)].node_id,
                           leaf=live[r % len(live)].leaf, gpus=()) for r in range(shape.world_size))
    return PlacementPlan(slots=slots)
