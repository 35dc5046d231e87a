"""The simulated cluster of bench/placement.py: topology, occupancy, and Ray's baselines.

512 nodes x 8 GPUs in 32 leaves under 4 spines, filled to a target occupancy by
randomly placed earlier jobs, plus simulations of Ray's PACK and SPREAD
placement-group strategies applied to the same snapshot.
"""

from __future__ import annotations

import random

from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.placement.solver import (
    Infeasible,
    JobShape,
    PlacementPlan,
    RankSlot,
    traffic_from_spec,
)

SEED = 20240611

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
    ordering nodes by id (what the PACK simulation does) is arbitrary but
    reproducible and unrelated to the topology. Both clusters get the same ids.
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


# -- the baseline: Ray placement-group strategies ---------------------------------

def _bundle_order(nodes: tuple[NodeInfo, ...]) -> list[NodeInfo]:
    # The raylet's iteration order: by node id (random hex), blind to leaves and islands.
    return sorted((n for n in nodes if n.alive), key=lambda n: n.node_id)


def _plan(picks: list[tuple[NodeInfo, int]]) -> PlacementPlan:
    # Ray hands ranks out in bundle order (and does not even keep bundle order
    # aligned with nodes, ray-project/ray#51117, so this is the favourable case).
    return PlacementPlan(slots=tuple(RankSlot(rank=r, node=n.name, node_id=n.node_id, leaf=n.leaf,
                                              gpus=(g,)) for r, (n, g) in enumerate(picks)))


def ray_pack(nodes: tuple[NodeInfo, ...], used: dict[str, set[int]],
             shape: JobShape) -> PlacementPlan | Infeasible:
    """Ray PACK for world_size bundles of {GPU: 1}: fill each node in id order, lowest free GPU first."""
    assert shape.gpus_per_rank == 1
    need, picks = shape.world_size, []
    for n in _bundle_order(nodes):
        taken = used.get(n.name, ())
        for g in range(n.gpus):
            if g not in taken:
                picks.append((n, g))
                if len(picks) == need:
                    return _plan(picks)
    return Infeasible(f"PACK: {need} bundles, {len(picks)} free GPUs")


def ray_spread(nodes: tuple[NodeInfo, ...], used: dict[str, set[int]],
               shape: JobShape) -> PlacementPlan | Infeasible:
    """Ray SPREAD for {GPU: 1} bundles: round robin over the nodes with a free GPU, in id order."""
    assert shape.gpus_per_rank == 1
    free = [(n, [g for g in range(n.gpus) if g not in used.get(n.name, ())]) for n in _bundle_order(nodes)]
    need, picks = shape.world_size, []
    while len(picks) < need:
        progressed = False
        for n, gpus in free:
            if gpus and len(picks) < need:
                picks.append((n, gpus.pop(0)))
                progressed = True
        if not progressed:
            return Infeasible(f"SPREAD: {need} bundles, {len(picks)} free GPUs")
    return _plan(picks)
