"""`kc topology probe`: measure node-to-node latency and bandwidth with Ray.

One small actor is pinned to each live node; for every pair, the probe times
round trips of a tiny call (latency) and the transfer of a large object from
one node's object store to the other's (bandwidth). Results go to Redis
(`info:probe`). The registry uses them where labels are silent: nodes that
carry no `kc.io/leaf` label are grouped into measured leaves (leaves.py), and
leaves that carry no `kc.io/spine` label into measured spines, leaves whose
mutual bandwidth is close to the best measured, so the placement solver's
"stay under one leaf, then one spine" rules work on clusters nobody labelled.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import replace
from typing import Any

from kuangchao.platform.cluster.leaves import leaf_report, measured_leaves, probed_leaves
from kuangchao.platform.cluster.topology import DEFAULT_LEAF, NodeInfo
from kuangchao.platform.errors import ClusterError

SAME_SPINE_FRACTION = 0.7  # leaves within 70% of the best bandwidth share a spine
# Starts of a node's probe actor: a worker process can die before it runs (seen on a busy
# netns node), and one more start is cheaper than a failed probe.
PEER_STARTS = 3
START_TIMEOUT_S = 120.0


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

    def start(n: NodeInfo) -> Any:
        return cls.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            n.node_id, soft=False)).remote(size)

    peers = start_peers(live, start)
    try:
        pairs = []
        for a, b in itertools.combinations(live, 2):
            lat = ray.get(peers[a.name].pings.remote(peers[b.name], rounds * 4), timeout=120)
            xfer = ray.get(peers[a.name].fetch.remote(peers[b.name], rounds), timeout=300)
            pairs.append({"a": a.name, "b": b.name, "leaf_a": a.leaf, "leaf_b": b.leaf,
                          "latency_us": round(statistics.median(lat) * 1e6, 1),
                          "bandwidth_gbps": round(size * 8 / statistics.median(xfer) / 1e9, 3)})
    except ray.exceptions.RayError as exc:
        raise ClusterError(f"the probe lost a node's actor while measuring ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0]}); check the nodes (`kc doctor`) and run "
                           "the probe again") from None
    finally:
        for p in peers.values():
            _kill(p)
    # Each node's label leaf: a lone node has no pair to say it was measured.
    return {"measured_at": time.time(), "size_mb": size_mb, "pairs": pairs,
            "node_leaves": {n.name: n.leaf for n in live}}


def start_peers(live: list[NodeInfo], start: Any) -> dict[str, Any]:
    """A ready probe actor on each node: one whose worker died before it ran, or that did
    not answer within START_TIMEOUT_S, is started again, up to PEER_STARTS times.

    Raises:
        ClusterError: A node's actor never came up (named, with Ray's reason).
    """
    import ray

    peers: dict[str, Any] = {}
    ready: set[str] = set()
    why: dict[str, str] = {}
    for _ in range(PEER_STARTS):
        for n in live:
            if n.name not in peers:
                peers[n.name] = start(n)
        refs = {p.ping.remote(): name for name, p in peers.items() if name not in ready}
        done, late = ray.wait(list(refs), num_returns=len(refs), timeout=START_TIMEOUT_S)
        why = {refs[r]: f"no answer within {START_TIMEOUT_S:.0f} s" for r in late}
        for r in done:
            try:
                ray.get(r)
                ready.add(refs[r])
            except ray.exceptions.RayActorError as exc:
                why[refs[r]] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        for name in why:
            _kill(peers.pop(name))
        if not why:
            return peers
    for p in peers.values():
        _kill(p)
    raise ClusterError(f"the probe's actor did not start on {', '.join(sorted(why))} after "
                       f"{PEER_STARTS} tries ({'; '.join(why.values())}); check those nodes "
                       "(`kc doctor`) and run the probe again")


def _kill(actor: Any) -> None:
    import ray

    try:
        ray.kill(actor)
    except Exception:  # noqa: BLE001 -- already gone is what we wanted
        pass


def measured_spines(probe: dict[str, Any], leaf_of: dict[str, str] | None = None) -> dict[str, str]:
    """Group leaves into spines by measured bandwidth (pure).

    Two leaves share a spine when the median bandwidth between their nodes is
    at least `SAME_SPINE_FRACTION` of the best cross-leaf bandwidth measured.

    Args:
        leaf_of: Node name -> its leaf now (labels and measured leaves); a node
            not in it keeps the leaf the probe recorded.

    Returns:
        leaf -> derived spine name (`probed-0`, `probed-1`, ...).
    """
    leaf_of = leaf_of or {}
    by_pair: dict[tuple[str, str], list[float]] = {}
    leaves = {leaf_of.get(n, lf) for n, lf in probed_leaves(probe).items()}
    for p in probe.get("pairs", []):
        la, lb = leaf_of.get(p["a"], p["leaf_a"]), leaf_of.get(p["b"], p["leaf_b"])
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
    """Fill in the leaves and spines the labels left out from measurements.

    Labels always win: only a node on the default leaf (no `kc.io/leaf` label)
    gets a measured leaf, and only a leaf without a `kc.io/spine` label a
    measured spine. A node the probe did not measure (it joined since) keeps
    the default leaf until the next probe.
    """
    if not probe:
        return nodes
    found = measured_leaves(probe, [n.name for n in nodes if n.leaf == DEFAULT_LEAF])
    nodes = tuple(replace(n, leaf=found[n.name], leaf_measured=True) if n.name in found else n
                  for n in nodes)
    spines = measured_spines(probe, {n.name: n.leaf for n in nodes})
    return tuple(replace(n, spine=spines.get(n.leaf)) if n.spine is None and n.leaf in spines else n
                 for n in nodes)


def found_leaves(probe: dict[str, Any]) -> list[dict[str, Any]]:
    """The leaves measured for the probe's unlabelled nodes, each with its nodes,
    the median bandwidth inside it and across (leaves.py), and its measured spine."""
    found = measured_leaves(probe)
    spines = measured_spines(probe, found)
    return [{**r, "spine": spines.get(r["leaf"])} for r in leaf_report(probe, found)]
