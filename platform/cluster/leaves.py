"""Leaves from measurement: which unlabelled nodes share a leaf switch (pure).

`kc topology probe` measures the bandwidth of every pair of live nodes
(probe.py). Where a node has no `kc.io/leaf` label, this module groups such
nodes into measured leaves: nodes under one leaf talk at about the best rate
their links allow, nodes under different leaves share an oversubscribed
uplink and talk slower.

The rule, and why:

* Each pair's bandwidth is the median of its measurements, so one slow or
  fast transfer does not decide.
* A node's reference is its best link. A pair is "fast" when its bandwidth is
  at least `SAME_LEAF_FRACTION` of the better reference of its two nodes. A
  per-node reference (not the cluster's one best pair) lets a leaf of slower
  NICs still form a leaf of its own. Noise above a link's rate is rare (no
  transfer beats its link), so the best link is a sound reference.
* Average linkage: clusters start as single nodes and two clusters merge only
  when the mean bandwidth over all their measured cross pairs is fast. One
  noisy fast pair between two slow-linked groups is outvoted by the slow ones.
* Merge order by neighbour agreement: before bandwidth, clusters merge first
  whose nodes agree on who else is fast to them. Two nodes of one leaf are fast
  to the same third nodes; a noisy fast pair across leaves is not, so it
  cannot merge two singletons ahead of their true leaf-mates (which greedy
  average linkage by bandwidth alone would let happen).
* A missing measurement is unknown: it is left out of every average, and two
  clusters with no measured pair between them never merge.
* Only unlabelled nodes are grouped, among themselves: an unlabelled node is
  never put into a labelled leaf, whatever it measures (labels always win, and
  a leaf half labelled is an operator's mistake to fix, not to guess around).

Leaves are named `probed-leaf-0`, `probed-leaf-1`, ... ordered by each one's
smallest node name, so the same cluster measured twice gets the same names.
"""

from __future__ import annotations

import heapq
import statistics
from collections.abc import Iterable
from typing import Any

from kuangchao.platform.cluster.topology import DEFAULT_LEAF

SAME_LEAF_FRACTION = 0.7  # a pair within 70% of its nodes' best link: same leaf
LEAF_PREFIX = "probed-leaf-"

Pair = tuple[str, str]


def _key(a: str, b: str) -> Pair:
    return (a, b) if a < b else (b, a)


def pair_medians(probe: dict[str, Any]) -> dict[Pair, float]:
    """Median bandwidth (Gbit/s) of each unordered pair over its measurements."""
    seen: dict[Pair, list[float]] = {}
    for p in probe.get("pairs", []):
        if p["a"] != p["b"] and p.get("bandwidth_gbps") is not None:
            seen.setdefault(_key(p["a"], p["b"]), []).append(float(p["bandwidth_gbps"]))
    return {k: statistics.median(v) for k, v in seen.items()}


def probed_leaves(probe: dict[str, Any]) -> dict[str, str]:
    """Each measured node's leaf as recorded when it was measured (its label)."""
    out: dict[str, str] = {}
    for p in probe.get("pairs", []):
        out.setdefault(p["a"], p.get("leaf_a") or DEFAULT_LEAF)
        out.setdefault(p["b"], p.get("leaf_b") or DEFAULT_LEAF)
    # `node_leaves` (newer probes): every node measured, a lone one too.
    for name, leaf in (probe.get("node_leaves") or {}).items():
        out.setdefault(name, leaf or DEFAULT_LEAF)
    return out


def measured_leaves(probe: dict[str, Any], names: Iterable[str] | None = None,
                    fraction: float = SAME_LEAF_FRACTION) -> dict[str, str]:
    """Group nodes into measured leaves by bandwidth.

    Args:
        probe: `kc topology probe`'s result (`pairs`, each with a, b,
            bandwidth_gbps; `node_leaves`, each node measured -> its label).
        names: The nodes to group: those without a leaf label. Default: the
            nodes the probe recorded on the default leaf. Nodes the probe did
            not measure are left out of the answer.
        fraction: How close to a node's best link a pair must be to count as
            fast.

    Returns:
        node name -> `probed-leaf-N`.
    """
    known = probed_leaves(probe)
    if names is None:
        names = [n for n, leaf in known.items() if leaf == DEFAULT_LEAF]
    nodes = sorted({n for n in names if n in known})
    inside = set(nodes)
    bw = {k: v for k, v in pair_medians(probe).items() if k[0] in inside and k[1] in inside}
    ref = dict.fromkeys(nodes, 0.0)
    for (a, b), v in bw.items():
        ref[a], ref[b] = max(ref[a], v), max(ref[b], v)
    groups = _average_linkage(nodes, bw, ref, _agreement(nodes, bw, ref, fraction), fraction)
    groups.sort(key=min)
    return {n: f"{LEAF_PREFIX}{i}" for i, g in enumerate(groups) for n in g}


def _agreement(nodes: list[str], bw: dict[Pair, float], ref: dict[str, float],
               fraction: float) -> dict[Pair, float]:
    """For each measured pair, in [-1, 1]: how far its two nodes agree on which
    third nodes are fast to them (+1 all agree, -1 none), over the third nodes
    measured with both; 0 without one."""
    measured: dict[str, set[str]] = {n: set() for n in nodes}
    fast: dict[str, set[str]] = {n: set() for n in nodes}
    for (a, b), v in bw.items():
        measured[a].add(b)
        measured[b].add(a)
        if v >= fraction * max(ref[a], ref[b]):
            fast[a].add(b)
            fast[b].add(a)
    out = {}
    for a, b in bw:
        common = measured[a] & measured[b]  # neither a nor b: no node measures itself
        differ = len((fast[a] ^ fast[b]) & common)
        out[(a, b)] = (len(common) - 2 * differ) / len(common) if common else 0.0
    return out


def _average_linkage(nodes: list[str], bw: dict[Pair, float], ref: dict[str, float],
                     agree: dict[Pair, float], fraction: float) -> list[list[str]]:
    """Merge clusters while some pair of them is fast on average; see the module doc.

    Candidate merges wait in a heap; a merge makes the merged cluster's entries
    stale (its version moves on) and pushes its new ones, so a probe of a hundred
    nodes is grouped in well under a second, each scheduling cycle.
    """
    groups: dict[int, list[str]] = {i: [n] for i, n in enumerate(nodes)}
    best = {i: ref[n] for i, n in enumerate(nodes)}
    version = dict.fromkeys(groups, 0)
    # Between two clusters: [sum of bandwidths, sum of agreements, measured pairs],
    # one list shared by both directions.
    links: dict[int, dict[int, list[float]]] = {i: {} for i in groups}
    index = {n: i for i, n in enumerate(nodes)}
    for (a, b), v in bw.items():
        links[index[a]][index[b]] = links[index[b]][index[a]] = [v, agree[(a, b)], 1]
    heap: list[tuple[float, float, str, str, int, int, int, int]] = []

    def push(i: int, k: int) -> None:
        total, votes, count = links[i][k]
        mean = total / count
        if mean > 0 and mean >= fraction * max(best[i], best[k]):
            lo, hi = sorted((i, k), key=lambda c: min(groups[c]))
            # Most agreement first, then the faster; ties by the smallest names.
            heapq.heappush(heap, (-votes / count, -mean, min(groups[lo]), min(groups[hi]),
                                  lo, hi, version[lo], version[hi]))

    for i in groups:
        for k in links[i]:
            if i < k:
                push(i, k)
    while heap:
        *_, i, j, vi, vj = heapq.heappop(heap)
        if i not in groups or j not in groups or (vi, vj) != (version[i], version[j]):
            continue  # stale: one of the two has merged since
        groups[i] += groups.pop(j)
        best[i] = max(best[i], best.pop(j))
        version[i] += 1
        for k, val in links.pop(j).items():
            del links[k][j]
            if k == i:
                continue
            mine = links[i].get(k)
            if mine is None:
                links[i][k] = links[k][i] = list(val)
            else:
                mine[:] = [x + y for x, y in zip(mine, val, strict=True)]
        for k in links[i]:
            push(i, k)
    return list(groups.values())


def leaf_report(probe: dict[str, Any], leaf_of: dict[str, str]) -> list[dict[str, Any]]:
    """Per measured leaf: its nodes and the median bandwidth inside it and from it
    to other nodes (None where no such pair was measured), for `kc topology probe`."""
    bw = pair_medians(probe)
    out = []
    for leaf in sorted(set(leaf_of.values()), key=lambda lf: min(n for n, x in leaf_of.items()
                                                                  if x == lf)):
        members = sorted(n for n, x in leaf_of.items() if x == leaf)
        intra = [v for (a, b), v in bw.items() if a in members and b in members]
        inter = [v for (a, b), v in bw.items() if (a in members) != (b in members)]
        out.append({"leaf": leaf, "nodes": members,
                    "intra_gbps": round(statistics.median(intra), 3) if intra else None,
                    "inter_gbps": round(statistics.median(inter), 3) if inter else None})
    return out
