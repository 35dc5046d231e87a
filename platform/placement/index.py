"""Free capacity indexed by leaf, for many placements over one slowly changing cluster.

The solver needs, for a group size k, every free "group slot" (k free GPUs in
one island of one node) per leaf, nodes in best-fit order. Recomputing that
from every node on each call is O(nodes); a scheduling cycle that places
hundreds of jobs on thousands of nodes would spend nearly all its time there.
`FreeIndex` keeps those lists per leaf, computes them lazily for the group
sizes actually asked for, and recomputes only the leaves whose nodes lost
GPUs since (`take`). Within a cycle GPUs only ever become taken, never free,
so `take` is the only update it needs.

Pure: topology values only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.placement.pools import Pool, pools_of


@dataclass(frozen=True)
class GroupSlot:
    """Room for one tensor-parallel group: GPU ids inside one island of one node."""

    node: NodeInfo
    gpus: tuple[int, ...]


def node_group_slots(node: NodeInfo, free: set[int] | frozenset[int], k: int,
                     tp: int) -> list[GroupSlot]:
    """The group slots of size `k` on one node, tightest island first."""
    # Tightest islands first: a group that exactly fills an island leaves no scrap.
    islands = sorted(((sorted(g for g in isl if g in free), isl[0]) for isl in node.islands),
                     key=lambda x: (len(x[0]), x[1]))
    if tp == 1 and all(len(isl) < k for isl in node.islands):
        # One rank with more GPUs than an island: it needs one node, not one island.
        avail = [g for ids, _ in islands for g in ids]
        return [GroupSlot(node, tuple(sorted(avail[j * k:(j + 1) * k])))
                for j in range(len(avail) // k)]
    out = []
    for avail, _ in islands:
        out += [GroupSlot(node, tuple(avail[j * k:(j + 1) * k])) for j in range(len(avail) // k)]
    return out


@dataclass(frozen=True)
class Scope:
    """The live nodes one placement may use (one pool, or several for a mixed job),
    summarised once: the totals the solver's early exits compare against."""

    nodes: tuple[NodeInfo, ...]
    types: frozenset[str | None]
    gpus: int
    largest_island: int
    largest_node: int
    spine: Mapping[str, str | None]  # leaf -> spine, as the scope's nodes say


class FreeIndex:
    """Free GPUs of `nodes` given `used`, with group slots per leaf cached per (k, tp).

    Args:
        nodes: The cluster's nodes (dead ones are kept but never offered).
        used: GPU ids already taken, by node name; copied, never mutated.
    """

    def __init__(self, nodes: tuple[NodeInfo, ...], used: Mapping[str, Iterable[int]]) -> None:
        self.nodes = nodes
        self.live = tuple(n for n in nodes if n.alive)
        self._by_name = {n.name: n for n in self.live}
        self._used: dict[str, set[int]] = {n.name: set(used.get(n.name, ())) for n in self.live}
        self._free_n = {n.name: n.gpus - len(self._used[n.name]) for n in self.live}
        self._free_by_type: dict[str | None, int] = {}
        for n in self.live:
            self._free_by_type[n.gpu_type] = self._free_by_type.get(n.gpu_type, 0) + self._free_n[n.name]
        self._leaf_nodes: dict[str, list[NodeInfo]] = {}
        for n in self.live:
            self._leaf_nodes.setdefault(n.leaf, []).append(n)
        self._slots: dict[tuple[int, int], dict[str, list[GroupSlot]]] = {}
        self._dirty: dict[tuple[int, int], set[str]] = {}
        self._pools: dict[tuple[str, ...], list[Pool]] = {}
        self._scopes: dict[frozenset, Scope] = {}

    # -- reading --------------------------------------------------------------------
    def pools(self, gpu_types: tuple[str, ...]) -> list[Pool]:
        """`pools_of(nodes, gpu_types)`, once per type list (many jobs ask alike)."""
        if gpu_types not in self._pools:
            self._pools[gpu_types] = pools_of(self.nodes, gpu_types)
        return self._pools[gpu_types]

    def scope(self, pools: list[Pool]) -> Scope:
        """The summary of these pools' nodes, computed once per set of types."""
        types = frozenset(p.gpu_type for p in pools)
        if types not in self._scopes:
            nodes = tuple(n for p in pools for n in p.nodes)
            self._scopes[types] = Scope(
                nodes=nodes, types=types, gpus=sum(n.gpus for n in nodes),
                largest_island=max((len(isl) for n in nodes for isl in n.islands), default=0),
                largest_node=max((n.gpus for n in nodes), default=0),
                spine={n.leaf: n.spine for n in nodes})
        return self._scopes[types]

    def free_in(self, scope: Scope) -> int:
        """Free GPUs on the scope's nodes."""
        return sum(self._free_by_type.get(t, 0) for t in scope.types)

    def leaf_slots(self, k: int, tp: int, scope: Scope) -> dict[str, list[GroupSlot]]:
        """Group slots of size `k` per leaf on the scope's nodes: nodes with the
        fewest free GPUs first (best fit), then by name. Fresh lists: callers may
        reorder or trim them."""
        key = (k, tp)
        cached = self._slots.get(key)
        if cached is None:
            cached = self._slots[key] = {lf: self._compute_leaf(lf, k, tp) for lf in self._leaf_nodes}
            self._dirty[key] = set()
        dirty = self._dirty[key]
        for lf in dirty:
            cached[lf] = self._compute_leaf(lf, k, tp)
        dirty.clear()
        if len(scope.types) == len(self._free_by_type):  # every live node: no filter
            return {lf: list(s) for lf, s in cached.items() if s}
        out: dict[str, list[GroupSlot]] = {}
        for lf, s in cached.items():
            mine = [g for g in s if g.node.gpu_type in scope.types]
            if mine:
                out[lf] = mine
        return out

    def _compute_leaf(self, leaf: str, k: int, tp: int) -> list[GroupSlot]:
        # Nodes with fewer than k free GPUs hold no group: skipped before sorting.
        out: list[GroupSlot] = []
        for node in sorted((n for n in self._leaf_nodes[leaf] if self._free_n[n.name] >= k),
                           key=lambda n: (self._free_n[n.name], n.name)):
            free = set(range(node.gpus)) - self._used[node.name]
            out += node_group_slots(node, free, k, tp)
        return out

    # -- updating -------------------------------------------------------------------
    def take(self, gpus: Mapping[str, Iterable[int]]) -> None:
        """These GPUs are taken from now on (taken twice is taken once); the leaves
        of their nodes are recomputed the next time their slots are asked for."""
        for name, ids in gpus.items():
            node = self._by_name.get(name)
            if node is None:  # dead or unknown: never offered anyway
                continue
            held = self._used[name]
            before = len(held)
            held.update(ids)
            gone = len(held) - before
            if not gone:
                continue
            self._free_n[name] -= gone
            self._free_by_type[node.gpu_type] -= gone
            for dirty in self._dirty.values():
                dirty.add(node.leaf)
