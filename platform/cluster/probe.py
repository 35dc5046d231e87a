"""`kc topology probe`: measure node-to-node latency and bandwidth with Ray.

One small actor is pinned to each live node; for every pair, the probe times
round trips of a tiny call (latency) and the transfer of a large object from
one node's object store to the other's (bandwidth). Results go to Redis
(`info:probe`). The registry uses them where labels are silent: leaves that
carry no `kc.io/spine` label are grouped into measured spines, leaves whose
mutual bandwidth is close to the best measured, so the placement solver's
"stay under one spine" rule works on clusters nobody labelled.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import replace
from typing import Any

from kuangchao.platform.cluster.topology import NodeInfo

SAME_SPINE_FRACTION = 0.7  # leaves within 70% of the best bandwidth share a spine


class _Peer:
    """Pinned to one node: answers pings and hands out a payload."""

    def __init__(self, size: int) -> None:
        self.payload = b"\0" * size

    def ping(self) -> int:
        return 0

    def blob(self) -> bytes:
        return self.payload

    def fetch(self, other: Any, rounds: int) -> list[float]:
        import ray

        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            data = ray.get(other.blob.remote())
            times.append(time.perf_counter() - t0)
            del data
        return times

    def pings(self, other: Any, rounds: int) -> list[float]:
        import ray

        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            ray.get(other.ping.remote())
            times.append(time.perf_counter() - t0)
        return times


def measure(nodes: tuple[NodeInfo, ...], size_mb: float = 16.0, rounds: int = 5) -> dict[str, Any]:
    """Measure every pair of live nodes. Needs `ray.init` done by the caller."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    live = [n for n in nodes if n.alive]
    size = int(size_mb * 1024 * 1024)
    cls = ray.remote(_Peer)
    peers = {n.name: cls.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
        n.node_id, soft=False)).remote(size) for n in live}
    try:
        ray.get([p.ping.remote() for p in peers.values()], timeout=120)
        pairs = []
        for a, b in itertools.combinations(live, 2):
            lat = ray.get(peers[a.name].pings.remote(peers[b.name], rounds * 4), timeout=120)
            xfer = ray.get(peers[a.name].fetch.remote(peers[b.name], rounds), timeout=300)
            pairs.append({"a": a.name, "b": b.name, "leaf_a": a.leaf, "leaf_b": b.leaf,
                          "latency_us": round(statistics.median(lat) * 1e6, 1),
                          "bandwidth_gbps": round(size * 8 / statistics.median(xfer) / 1e9, 3)})
    finally:
        for p in peers.values():
            ray.kill(p)
    return {"measured_at": time.time(), "size_mb": size_mb, "pairs": pairs}


def measured_spines(probe: dict[str, Any]) -> dict[str, str]:
    """Group leaves into spines by measured bandwidth (pure).

    Two leaves share a spine when the median bandwidth between their nodes is
    at least `SAME_SPINE_FRACTION` of the best cross-leaf bandwidth measured.

    Returns:
        leaf -> derived spine name (`probed-0`, `probed-1`, ...).
    """
    by_pair: dict[tuple[str, str], list[float]] = {}
    leaves: set[str] = set()
    for p in probe.get("pairs", []):
        la, lb = p["leaf_a"], p["leaf_b"]
        leaves |= {la, lb}
        if la != lb:
            by_pair.setdefault(tuple(sorted((la, lb))), []).append(p["bandwidth_gbps"])
    bw = {k: statistics.median(v) for k, v in by_pair.items()}
    best = max(bw.values(), default=0.0)
    parent = {lf: lf for lf in leaves}

    def find(x: str) -> str:
        while parent[x] != x:
            x = parent[x]
        return x

    for (la, lb), value in sorted(bw.items()):
        if best and value >= SAME_SPINE_FRACTION * best:
            parent[find(la)] = find(lb)
    roots = sorted({find(lf) for lf in leaves}, key=lambda r: min(lf for lf in leaves if find(lf) == r))
    name = {r: f"probed-{i}" for i, r in enumerate(roots)}
    return {lf: name[find(lf)] for lf in sorted(leaves)}


def apply_probe(nodes: tuple[NodeInfo, ...], probe: dict[str, Any] | None) -> tuple[NodeInfo, ...]:
    """Fill in spines the labels left out from measurements; labels always win."""
    if not probe:
        return nodes
    spines = measured_spines(probe)
    return tuple(replace(n, spine=spines.get(n.leaf)) if n.spine is None and n.leaf in spines else n
                 for n in nodes)
