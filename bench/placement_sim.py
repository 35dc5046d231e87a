"""The simulated cluster of bench/placement.py: topology, occupancy, and Ray's baselines.

512 nodes x 8 GPUs in 32 leaves under 4 spines, filled to a target occupancy by
randomly placed earlier jobs, plus Ray's PACK and SPREAD placement-group
strategies re-implemented from Ray's own scheduling code and applied to the
same snapshot (`ray_pack`, `ray_spread`; the procedure is `schedule_pg`, whose
docstring says what it follows, file by file).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.placement.solver import (
    Infeasible,
    JobShape,
    PlacementPlan,
    RankSlot,
    traffic_from_spec,
)

SEED = 20240611
T = TypeVar("T")

# -- the simulated cluster ------------------------------------------------------

GPUS_PER_NODE = 8
NVSWITCH = (tuple(range(8)),)  # one 8-GPU NVLink island per node
TWO_ISLANDS = ((0, 1, 2, 3), (4, 5, 6, 7))  # two 4-GPU islands per node
BIG_JOB = JobShape(dp=32, tp=8, pp=4)  # 1,024 GPUs, a TP group fills a node
# The traffic the scheduler would pass for such a job: a 70B-class decoder
# (80 layers, d_model 8192, 4k context, 16 micro-batches of 1 per step).
BIG_TRAFFIC = traffic_from_spec({
    "model": {"n_layers": 80, "d_model": 8192, "seq_len": 4096, "vocab_size": 32000},
    "parallel": {"micro_batch_size": 1, "gradient_accumulation_steps": 16}})
BIG_JOB_4GPU_ISLANDS = JobShape(dp=64, tp=4, pp=4)  # 1,024 GPUs, a TP group fills an island


def make_cluster(islands: tuple[tuple[int, ...], ...], nodes: int = 512, per_leaf: int = 16,
                 leaves_per_spine: int = 8, seed: int = SEED) -> tuple[NodeInfo, ...]:
    """`nodes` x 8 GPUs; leaf-NN holds 16 consecutive nodes, spine-N 8 consecutive leaves.

    Node ids are random 56-hex-digit strings like Ray's, from a fixed seed, so that
    node-id order (the first order the Ray simulation breaks ties in, standing for
    Ray's hash order) is arbitrary but reproducible and unrelated to the topology.
    Both clusters get the same ids.
    """
    rng = random.Random(seed)
    out = []
    for i in range(nodes):
        leaf = i // per_leaf
        out.append(NodeInfo(name=f"node-{i:03d}", gpus=GPUS_PER_NODE, islands=islands,
                            leaf=f"leaf-{leaf:02d}", spine=f"spine-{leaf // leaves_per_spine}",
                            cpus=96.0, node_id=f"{rng.getrandbits(224):056x}"))
    return tuple(out)


# Occupancy model. Earlier jobs arrive one by one until exactly half the GPUs are
# taken. Their GPU counts are drawn from JOB_MIX (weights are shares of the job
# COUNT): mostly whole-node 8/16/32/64-GPU jobs, some 1/2/4-GPU ones. Each lands
# at a random feasible position, never best fit: a job of under 8 GPUs on a
# uniformly random node with enough free GPUs, taking random free GPU ids there
# (so it can straddle NVLink islands, as Ray's GPU assignment ignores them); a
# job of 8 GPUs or more on uniformly random fully free nodes anywhere in the
# cluster (whole nodes, no leaf locality). A job that would overshoot 50% is cut
# down to the largest size in the mix that still fits. Seed fixed. With this mix
# the 1,024-GPU job is placeable on both clusters (checked at run time).
JOB_MIX = ((1, 0.06), (2, 0.06), (4, 0.08), (8, 0.30), (16, 0.22), (32, 0.16), (64, 0.12))


def occupy(nodes: tuple[NodeInfo, ...], fraction: float, rng: random.Random) -> list[list[tuple[str, int]]]:
    """Earlier jobs filling `fraction` of the GPUs; each is its (node, gpu) list in rank order."""
    free = {n.name: list(range(n.gpus)) for n in nodes}
    target = round(sum(n.gpus for n in nodes) * fraction)
    sizes, weights = zip(*JOB_MIX, strict=True)
    used, jobs = 0, []
    while used < target:
        size = rng.choices(sizes, weights)[0]
        size = min(size, max(s for s in sizes if s <= target - used))
        if size < GPUS_PER_NODE:
            room = [name for name, f in free.items() if len(f) >= size]
            name = rng.choice(room)
            gpus = sorted(rng.sample(free[name], size))
            free[name] = [g for g in free[name] if g not in gpus]
            job = [(name, g) for g in gpus]
        else:
            whole = [name for name, f in free.items() if len(f) == GPUS_PER_NODE]
            if len(whole) < size // GPUS_PER_NODE:
                raise SystemExit(f"occupancy model: no {size // GPUS_PER_NODE} free nodes left")
            job = []
            for name in rng.sample(whole, size // GPUS_PER_NODE):
                job += [(name, g) for g in free[name]]
                free[name] = []
        jobs.append(job)
        used += size
    return jobs


def used_of(jobs: list[list[tuple[str, int]]]) -> dict[str, set[int]]:
    used: dict[str, set[int]] = {}
    for job in jobs:
        for name, g in job:
            used.setdefault(name, set()).add(g)
    return used


def describe(nodes: tuple[NodeInfo, ...], used: dict[str, set[int]], jobs: list) -> str:
    busy = sum(len(v) for v in used.values())
    whole = sum(1 for n in nodes if not used.get(n.name))
    partial = sum(1 for n in nodes if 0 < len(used.get(n.name, ())) < n.gpus)
    per_leaf: dict[str, int] = {}
    for n in nodes:
        per_leaf[n.leaf] = per_leaf.get(n.leaf, 0) + (not used.get(n.name))
    return (f"{len(jobs)} earlier jobs, {busy}/{sum(n.gpus for n in nodes)} GPUs busy, "
            f"{whole} fully free nodes, {partial} partly used; fully free per leaf "
            f"min {min(per_leaf.values())} max {max(per_leaf.values())}")


# -- the baseline: Ray's placement-group scheduling, re-implemented ----------------
#
# What Ray does is in `schedule_pg`'s docstring, file by file; `ray_plan` turns its
# decision into ranks the way Ray Train does. tests/integration/test_ray_placement_sim.py
# checks `schedule_pg` against placement groups a real Ray cluster places.

RAY_VERSION = "2.60.0"  # the Ray whose code this follows, and which the integration test runs
PACK, SPREAD = "PACK", "SPREAD"
# Ray Train's bundle for one GPU worker: ScalingConfig(use_gpu=True) with resources_per_worker
# left at None gives {"GPU": 1} (ray/air/config.py, ScalingConfig._resources_per_worker_not_none).
TRAIN_BUNDLE = {"GPU": 1.0}

_UNIT = 10_000  # Ray's FixedPoint keeps resource amounts in integer units of 1/10,000
_PREDEFINED = frozenset({"CPU", "GPU", "memory", "object_store_memory"})
_THRESHOLD = 16  # libstdc++'s _S_threshold: ranges this short are left to insertion sort

Chooser = Callable[[list[str], int], str]


@dataclass(frozen=True)
class RayNode:
    """One node as the GCS's cluster resource view has it: its id and what is free on it."""

    node_id: str
    available: Mapping[str, float]


class SortDepthExceeded(Exception):
    """libstdc++'s introsort would fall back to heap sort here, which is not simulated."""


def cxx_sort(items: Sequence[T], before: Callable[[T, T], bool]) -> list[T]:
    """`items` in the order libstdc++'s std::sort leaves them under the comparator `before`.

    std::sort is not stable, and Ray sorts a placement group's bundles with it, so
    which equal bundle lands where is a property of the algorithm: libstdc++'s
    introsort (bits/stl_algo.h, unchanged from GCC 4 to 14; Ray's wheels are built
    with GCC and libstdc++). Its steps, rewritten here: while a range is longer than
    16, move the median of (second, middle, last) elements to the front, partition
    the rest around it with Hoare's unguarded scheme (swapping equal elements
    too), recurse on the right part and loop on the left; then one insertion sort
    over the whole array. On all-equal keys this permutes indices (for 20 equal
    bundles: 10, 19, 18, ..., 11, 0, 9, ..., 1). When the recursion passes
    2 * floor(log2 n) levels libstdc++ switches to heap sort; that never happens on
    the inputs here (few distinct keys split evenly) and raises SortDepthExceeded.
    """
    a = list(items)

    def swap(i: int, j: int) -> None:
        a[i], a[j] = a[j], a[i]

    def median_to_first(result: int, x: int, y: int, z: int) -> None:
        if before(a[x], a[y]):
            if before(a[y], a[z]):
                swap(result, y)
            elif before(a[x], a[z]):
                swap(result, z)
            else:
                swap(result, x)
        elif before(a[x], a[z]):
            swap(result, x)
        elif before(a[y], a[z]):
            swap(result, z)
        else:
            swap(result, y)

    def partition(first: int, last: int, pivot: int) -> int:
        while True:
            while before(a[first], a[pivot]):
                first += 1
            last -= 1
            while before(a[pivot], a[last]):
                last -= 1
            if not first < last:
                return first
            swap(first, last)
            first += 1

    def introsort(first: int, last: int, depth: int) -> None:
        while last - first > _THRESHOLD:
            if depth == 0:
                raise SortDepthExceeded(f"introsort depth limit on a range of {last - first}")
            depth -= 1
            median_to_first(first, first + 1, first + (last - first) // 2, last - 1)
            cut = partition(first + 1, last, first)
            introsort(cut, last, depth)
            last = cut

    def linear_insert(i: int) -> None:
        val, j = a[i], i - 1
        while j >= 0 and before(val, a[j]):
            a[j + 1] = a[j]
            j -= 1
        a[j + 1] = val

    def insertion_sort(first: int, last: int) -> None:
        for i in range(first + 1, last):
            if before(a[i], a[first]):
                a[first:i + 1] = [a[i], *a[first:i]]
            else:
                linear_insert(i)

    n = len(a)
    if n > 1:
        introsort(0, n, 2 * (n.bit_length() - 1))
        insertion_sort(0, min(n, _THRESHOLD))
        for i in range(_THRESHOLD, n):
            linear_insert(i)
    return a


def _fixed(amount: float) -> int:
    return int(amount * _UNIT + 0.5)


def _bundle_before(a: Mapping[str, int], b: Mapping[str, int]) -> bool:
    """SortRequiredResources' comparator: does bundle `a` go before `b`?"""
    if a.get("GPU", 0) != b.get("GPU", 0):
        return a.get("GPU", 0) > b.get("GPU", 0)
    # Ray walks the custom resources in its internal id order; name order stands in for it.
    for r in sorted((a.keys() | b.keys()) - _PREDEFINED):
        if a.get(r, 0) != b.get(r, 0):
            return a.get(r, 0) > b.get(r, 0)
    for r in ("object_store_memory", "memory", "CPU"):
        if a.get(r, 0) != b.get(r, 0):
            return a.get(r, 0) > b.get(r, 0)
    return False


def bundle_order(bundles: Sequence[Mapping[str, float]]) -> list[int]:
    """Bundle indices in the order Ray places them (SortRequiredResources)."""
    reqs = [{r: _fixed(q) for r, q in b.items() if q > 0} for b in bundles]
    return cxx_sort(range(len(reqs)), lambda i, j: _bundle_before(reqs[i], reqs[j]))


def least_resource_score(request: Mapping[str, int], available: Mapping[str, int]) -> float:
    """LeastResourceScorer::Score on fixed-point amounts: -1 if it does not fit, else
    the sum over the requested resources of (available - requested) / available."""
    if any(available.get(r, 0) < q for r, q in request.items()):
        return -1.0
    total = 0.0
    for r, q in request.items():
        a = available.get(r, 0)
        if a:
            total += ((a - q) / _UNIT) / (a / _UNIT)
    return total


def schedule_pg(strategy: str, bundles: Sequence[Mapping[str, float]], nodes: Sequence[RayNode],
                choose: Chooser | None = None) -> list[str] | None:
    """The node id Ray's GCS gives each bundle of a new placement group, or None (left pending).

    A re-implementation, for strategies PACK and SPREAD, of what Ray 2.60 runs
    (paths in github.com/ray-project/ray):

    * src/ray/gcs/gcs_placement_group_scheduler.cc, `ScheduleUnplacedBundles`:
      the bundles' resource requests, in bundle-index order, go to
      `ClusterResourceScheduler::Schedule` (src/ray/raylet/scheduling/
      cluster_resource_scheduler.cc), which hands them with the GCS's view of
      every alive node's available resources to the strategy's policy
      (policy/composite_scheduling_policy.cc); on success bundle i goes to the
      policy's node i. `nodes` is that view.
    * src/ray/raylet/scheduling/policy/bundle_scheduling_policy.cc:
      - `SortRequiredResources`: the bundles are put in order with std::sort, the
        most GPUs first, then more custom resources, object store memory, memory,
        CPU. std::sort is not stable, so among equal bundles the order is
        libstdc++'s introsort's (`cxx_sort`): with more than 16 equal bundles,
        bundle indices are permuted, and a node's bundles are not consecutive.
      - `GetBestNode`: scores every candidate node with `LeastResourceScorer` and
        keeps the FIRST one with the strictly highest score; a node that cannot
        hold the bundle scores -1 and is never chosen.
      - PACK (`BundlePackSchedulingPolicy::Schedule`): the first unplaced bundle
        (in sorted order) goes to the best node; then every later unplaced
        bundle that still fits there joins it, in sorted order; the node leaves
        the candidates. Repeat until all bundles are placed, or no candidate can
        hold the first unplaced bundle: then the whole group fails for now
        (nothing is reserved; the GCS retries later). So PACK starts on the
        EMPTIEST node, keeps filling it, and spills onto the next emptiest.
      - SPREAD (`BundleSpreadSchedulingPolicy::Schedule`): each bundle in sorted
        order goes to the best node this group has not used yet; when none can
        hold it, to the best of the nodes it has used (as left by its earlier
        bundles); when neither, the group fails for now.
    * src/ray/raylet/scheduling/policy/scorer.cc, `LeastResourceScorer::Score`:
      -1 unless every requested resource is available, else the sum over the
      requested resources of (available - requested) / available (a term is 0
      where available is 0); amounts are FixedPoint (1/10,000 units).

    Ties. `GetBestNode` walks an absl hash set of node ids, whose iteration order
    depends on a per-process hash seed: which of several equally scored nodes Ray
    takes is not reproducible. Here the nodes tied at the top score are listed in
    `nodes` order and `choose(tied, bundle)` picks one for the bundle being
    placed (default: the first). The integration test passes a chooser that
    follows real Ray's pick and fails when Ray's node is not among the tied ones,
    so "agrees up to ties" is checked, not assumed.

    Not modelled (absent from the bench and its test): bundle label selectors
    and label domains, soft target nodes, draining nodes, custom resources
    compared in Ray's internal id order (name order here), std::sort's heap-sort
    fallback (raises), and Ray's "infeasible" versus "failed" (both None).
    """
    if strategy not in (PACK, SPREAD):
        raise ValueError(f"only PACK and SPREAD are simulated, not {strategy!r}")
    if not bundles:
        raise ValueError("a placement group has at least one bundle")
    reqs = [{r: _fixed(q) for r, q in b.items() if q > 0} for b in bundles]
    free = {n.node_id: {r: _fixed(q) for r, q in n.available.items()} for n in nodes}
    order = [n.node_id for n in nodes]
    pick: Chooser = choose or (lambda tied, bundle: tied[0])

    def best(bundle: int, pool: list[str]) -> str | None:
        scores = [least_resource_score(reqs[bundle], free[n]) for n in pool]
        top = max(scores, default=-1.0)
        if top < 0:
            return None
        return pick([n for n, s in zip(pool, scores, strict=True) if s == top], bundle)

    def fits(node: str, bundle: int) -> bool:
        return all(free[node].get(r, 0) >= q for r, q in reqs[bundle].items())

    def take(node: str, bundle: int) -> None:
        for r, q in reqs[bundle].items():
            free[node][r] = free[node].get(r, 0) - q
        placed[bundle] = node

    placed: list[str] = [""] * len(bundles)
    sequence = bundle_order(bundles)
    candidates = list(order)
    if strategy == PACK:
        waiting = sequence
        while waiting:
            node = best(waiting[0], candidates)
            if node is None:
                return None
            rest = []
            for b in waiting:  # the first one fits: it scored >= 0 there
                if fits(node, b):
                    take(node, b)
                else:
                    rest.append(b)
            waiting = rest
            candidates.remove(node)
    else:
        used: set[str] = set()
        for b in sequence:
            node = best(b, candidates)
            if node is not None:
                candidates.remove(node)
                used.add(node)
            else:
                node = best(b, [n for n in order if n in used])
                if node is None:
                    return None
            take(node, b)
    return placed


class Disagreement(Exception):
    pass


def disagreement(strategy: str, bundles: Sequence[Mapping[str, float]], nodes: Sequence[RayNode],
                 observed: Sequence[str] | None) -> str | None:
    """Why Ray's decision `observed` (node id per bundle; None: left pending) is not
    what `schedule_pg` gives on the same view for any way of breaking its ties;
    None when it is. Ray's pick at every tie is followed, so every decision that
    is not a tie is checked exactly. (For a pending group only the default tie
    break is tried.)"""
    if observed is None:
        got = schedule_pg(strategy, bundles, nodes)
        return None if got is None else f"Ray left the group pending; the simulation places it: {got}"

    def follow(tied: list[str], bundle: int) -> str:
        if observed[bundle] not in tied:
            raise Disagreement(f"bundle {bundle}: Ray chose {observed[bundle]}, the best nodes are {tied}")
        return observed[bundle]

    try:
        got = schedule_pg(strategy, bundles, nodes, follow)
    except Disagreement as exc:
        return str(exc)
    if got is None:
        return "the simulation leaves the group pending; Ray placed it"
    wrong = {b: (observed[b], got[b]) for b in range(len(bundles)) if observed[b] != got[b]}
    return f"bundle: (Ray, simulation) {wrong}" if wrong else None


def ray_train_ranks(bundle_nodes: Sequence[str]) -> list[int]:
    """The bundle index of each world rank when Ray Train v2 runs one worker per bundle.

    ray/train/v2/_internal/execution/worker_group/worker_group.py: worker i is
    created in bundle i (`_create_workers`), then `_assign_worker_ranks` orders
    the workers with `_sort_workers_by_gpu_id_grouped_by_node`: nodes in the
    order of their first worker, a node's workers by lowest GPU id; world rank =
    position. A raylet reserves a node's bundles in bundle order (the GCS sends
    them so) and gives each the lowest free GPU ids (NodeResourceInstanceSet::
    TryAllocate, src/ray/common/scheduling/resource_instance_set.cc), so GPU
    order on a node is bundle order.
    """
    by_node: dict[str, list[int]] = {}
    for b, node in enumerate(bundle_nodes):
        by_node.setdefault(node, []).append(b)
    return [b for bs in by_node.values() for b in bs]


def ray_plan(strategy: str, nodes: tuple[NodeInfo, ...], used: dict[str, set[int]], shape: JobShape,
             order_seed: int | None = None, ranks: str = "ray_train") -> PlacementPlan | Infeasible:
    """Ray's placement of a job of `shape` as Ray Train would start it: one bundle
    TRAIN_BUNDLE per rank, `schedule_pg` on each alive node's free GPUs, GPU ids
    lowest free first in bundle order, ranks by `ray_train_ranks` (or, with
    ranks="bundle", rank i = bundle i, for comparison).

    Ties go to the first node in node-id order (random hex ids: an order blind to
    leaves and islands, as Ray's hash order is), or in an order shuffled by
    `order_seed`, to see how much the result depends on them.
    """
    assert shape.gpus_per_rank == 1, "Ray Train's GPU bundle holds one GPU"
    alive = sorted((n for n in nodes if n.alive), key=lambda n: n.node_id)
    if order_seed is not None:
        random.Random(order_seed).shuffle(alive)
    view = [RayNode(n.node_id, {"GPU": float(n.gpus - len(used.get(n.name, ())))}) for n in alive]
    placed = schedule_pg(strategy, [TRAIN_BUNDLE] * shape.world_size, view)
    if placed is None:
        free = sum(int(v.available["GPU"]) for v in view)
        return Infeasible(f"{strategy}: {shape.world_size} bundles of one GPU, {free} free GPUs")
    by_id = {n.node_id: n for n in alive}
    free_ids = {n.node_id: [g for g in range(n.gpus) if g not in used.get(n.name, ())] for n in alive}
    gpu_of = [free_ids[node_id].pop(0) for node_id in placed]
    order = ray_train_ranks(placed) if ranks == "ray_train" else list(range(len(placed)))
    return PlacementPlan(slots=tuple(
        RankSlot(rank=r, node=by_id[placed[b]].name, node_id=placed[b], leaf=by_id[placed[b]].leaf,
                 gpus=(gpu_of[b],)) for r, b in enumerate(order)))


def ray_pack(nodes: tuple[NodeInfo, ...], used: dict[str, set[int]], shape: JobShape,
             order_seed: int | None = None, ranks: str = "ray_train") -> PlacementPlan | Infeasible:
    """Ray Train's default: strategy PACK (ScalingConfig.placement_strategy)."""
    return ray_plan(PACK, nodes, used, shape, order_seed, ranks)


def ray_spread(nodes: tuple[NodeInfo, ...], used: dict[str, set[int]], shape: JobShape,
               order_seed: int | None = None, ranks: str = "ray_train") -> PlacementPlan | Infeasible:
    return ray_plan(SPREAD, nodes, used, shape, order_seed, ranks)
