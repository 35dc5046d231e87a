"""Placement quality and speed: kuangchao's solver against Ray's placement-group strategies.

Pure simulation in one process: no Ray, no Redis, no cluster. Every number comes
from `NodeInfo` snapshots handed to `place()` (ours), to a simulation of Ray's
PACK strategy (the baseline) and to the admission policy.

  solve_ms_p50                  median time of place() for a 1,024-GPU job (dp=32, tp=8, pp=4)
                                on 512 nodes x 8 GPUs (NVSwitch), 32 leaves, 4 spines, 50% busy
  tp_groups_split               TP groups spread over more than one NVLink island, same job
  tp_groups_split_4gpu_islands  the same on 8-GPU nodes with two 4-GPU islands (dp=64, tp=4, pp=4)
  cross_leaf_ring_edges         data-parallel ring edges that change leaf switch, ours over PACK's
  optimality_gap                mean gap to an exhaustive search on ~30 small random instances, %
  schedule_cycle_ms             one policy.decide() over 1,000 queued jobs on the 50%-busy cluster

Run: .venv/bin/python bench/placement.py   (one JSON object per line on stdout)
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.jobs.state import JobRecord, JobState, PlacedRank
from kuangchao.platform.placement.score import PlacementScore, Traffic, score
from kuangchao.platform.placement.solver import (
    Infeasible,
    JobShape,
    PlacementPlan,
    RankSlot,
    place,
)
from kuangchao.platform.scheduling import policies
from kuangchao.platform.scheduling.policies import Snapshot, make_policy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` when run as a script

from bench.harness import emit, log, median  # noqa: E402

BENCH = "placement"

from bench.placement_sim import (  # noqa: E402
    BIG_JOB,
    BIG_JOB_4GPU_ISLANDS,
    BIG_TRAFFIC,
    NVSWITCH,
    SEED,
    TWO_ISLANDS,
    describe,
    make_cluster,
    occupy,
    ray_pack,
    ray_spread,
    used_of,
)

# -- output -----------------------------------------------------------------------

def report(metric: str, unit: str, ours: float, baseline: float, target: float) -> None:
    """harness.emit, except that 0 over 0 is a ratio of 0.0 (harness.emit would say inf)."""
    if baseline == 0 and ours == 0:
        print(json.dumps({"bench": BENCH, "metric": metric, "unit": unit, "ours": 0.0, "baseline": 0.0,
                          "ratio": 0.0, "target": target}), flush=True)
        return
    emit(BENCH, metric, unit, ours, baseline, target)


def timed_ms(fn: Callable[[], object]) -> float:
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def fmt(sc: PlacementScore) -> str:
    return (f"split={sc.tp_groups_split} pipes_across={sc.pipelines_across_leaves} "
            f"ring_edges={sc.cross_leaf_ring_edges} leaves={sc.leaves_used} nodes={sc.nodes_used}")


def must_plan(result: PlacementPlan | Infeasible, what: str) -> PlacementPlan:
    if isinstance(result, Infeasible):
        raise SystemExit(f"{what} is infeasible under the occupancy model: {result.reason}; "
                         "make JOB_MIX richer in whole-node jobs")
    return result


# -- 1-3: the 1,024-GPU job ---------------------------------------------------------

def compare(nodes: tuple[NodeInfo, ...], used: dict[str, set[int]], shape: JobShape,
            ours: PlacementPlan, pack: PlacementPlan) -> tuple[PlacementScore, PlacementScore]:
    """Score ours and PACK on one snapshot; log both, and SPREAD for information."""
    so, sp = score(ours, nodes, shape), score(pack, nodes, shape)
    log(f"ours:   {fmt(so)}")
    log(f"PACK:   {fmt(sp)}")
    spread = ray_spread(nodes, used, shape)
    if isinstance(spread, PlacementPlan):
        log(f"SPREAD: {fmt(score(spread, nodes, shape))} (informative)")
    return so, sp


def big_job(repeats: int) -> None:
    nodes = make_cluster(NVSWITCH)
    jobs = occupy(nodes, 0.5, random.Random(SEED))
    used = used_of(jobs)
    log(f"NVSwitch cluster: {describe(nodes, used, jobs)}")
    ours = must_plan(place(nodes, used, BIG_JOB, BIG_TRAFFIC), "the 1,024-GPU job")
    pack = must_plan(ray_pack(nodes, used, BIG_JOB), "PACK")

    ours_ms, pack_ms = [], []
    for _ in range(repeats):  # interleaved, so drift hits both alike
        ours_ms.append(timed_ms(lambda: place(nodes, used, BIG_JOB, BIG_TRAFFIC)))
        pack_ms.append(timed_ms(lambda: ray_pack(nodes, used, BIG_JOB)))
    log(f"place(): median {median(ours_ms):.2f} ms, min {min(ours_ms):.2f}, max {max(ours_ms):.2f}; "
        f"PACK simulation: median {median(pack_ms):.2f} ms ({repeats} runs each)")
    report("solve_ms_p50", "ms", median(ours_ms), median(pack_ms), 100)

    so, sp = compare(nodes, used, BIG_JOB, ours, pack)
    report("tp_groups_split", "groups", so.tp_groups_split, sp.tp_groups_split, 0)

    nodes4 = make_cluster(TWO_ISLANDS)
    jobs4 = occupy(nodes4, 0.5, random.Random(SEED))
    used4 = used_of(jobs4)
    log(f"two-island cluster: {describe(nodes4, used4, jobs4)}")
    so4, sp4 = compare(
        nodes4, used4, BIG_JOB_4GPU_ISLANDS,
        must_plan(place(nodes4, used4, BIG_JOB_4GPU_ISLANDS, BIG_TRAFFIC), "the tp=4 job"),
        must_plan(ray_pack(nodes4, used4, BIG_JOB_4GPU_ISLANDS), "PACK, tp=4"))
    report("tp_groups_split_4gpu_islands", "groups", so4.tp_groups_split, sp4.tp_groups_split, 0)

    log(f"context: the 1,024-GPU job's {BIG_JOB.dp * BIG_JOB.pp} node-sized groups fit in no fewer than "
        f"{fewest_leaves(nodes, used, BIG_JOB)} leaves even with pipelines straddling leaves; "
        f"ours uses {so.leaves_used} ({so.pipelines_across_leaves} pipelines straddle a leaf)")
    report("cross_leaf_ring_edges", "edges", so.cross_leaf_ring_edges, sp.cross_leaf_ring_edges, 0.5)


def fewest_leaves(nodes: tuple[NodeInfo, ...], used: dict[str, set[int]], shape: JobShape) -> int:
    """Fewest leaves with room for all of the job's TP groups, ignoring pipelines."""
    k, room = shape.group_gpus, {}
    for n in nodes:
        for isl in n.islands:
            room[n.leaf] = room.get(n.leaf, 0) + sum(g not in used.get(n.name, ()) for g in isl) // k
    need, got = shape.dp * shape.pp, 0
    for i, r in enumerate(sorted(room.values(), reverse=True), 1):
        got += r
        if got >= need:
            return i
    return len(room)


# -- 4: optimality gap against exhaustive search --------------------------------------
#
# Cost of a plan (lower is better), from `score(plan, nodes, shape, Traffic(1, 1))`:
#
#     cost = SPLIT_PENALTY * tp_groups_split + cross_leaf_bytes
#
# where cross_leaf_bytes = (DP ring edges that change leaf) * 2(dp-1)/(dp*tp*pp)
#                        + (pipeline stage boundaries, per TP rank, that change leaf) * 1,
# i.e. the per-step bytes that cross a leaf switch for 1 byte of gradients and
# 1 byte of activations. It orders pipelines_across_leaves and cross_leaf_ring_edges
# by the traffic they cost instead of strictly lexicographically, and leaves_used
# only through them. SPLIT_PENALTY exceeds any cross_leaf_bytes these instances
# can reach (at most 8 groups), so a split TP group always costs more than any
# placement that keeps them whole. The strict lexicographic order
# (tp_groups_split, pipelines_across_leaves, cross_leaf_ring_edges, leaves_used)
# is checked as well and logged.
#
# Exhaustive search. A valid placement puts each TP group on tp free GPUs of one
# island. The cost depends only on which LEAF each group is in (the score compares
# ranks' leaves; within valid placements nothing is split), and any sequence of
# leaves (one per group, in rank order) is realizable iff no leaf gets more groups
# than it has room for (sum over its islands of free // tp). So the minimum over
# all valid placements is the minimum over those leaf sequences, each realized
# into one concrete plan and scored by `score()` itself. Symmetry pruning: GPUs
# in an island and islands in a leaf are interchangeable; leaves not used yet
# that have the same room are too, so only the first of them is tried.

SPLIT_PENALTY = 100.0
UNIT_TRAFFIC = Traffic(grad_bytes=1.0, activation_bytes=1.0)
EPS = 1e-9


def cost_of(sc: PlacementScore) -> float:
    return SPLIT_PENALTY * sc.tp_groups_split + sc.cross_leaf_bytes


def lex_of(sc: PlacementScore) -> tuple[int, int, int, int]:
    return (sc.tp_groups_split, sc.pipelines_across_leaves, sc.cross_leaf_ring_edges, sc.leaves_used)


@dataclass(frozen=True)
class Instance:
    nodes: tuple[NodeInfo, ...]
    used: dict[str, set[int]]
    shape: JobShape

    def text(self) -> str:
        leaves: dict[str, list[str]] = {}
        for n in self.nodes:
            free = [g for g in range(n.gpus) if g not in self.used.get(n.name, ())]
            leaves.setdefault(n.leaf, []).append(f"{n.name} free {free}")
        s = self.shape
        return (f"job dp={s.dp} tp={s.tp} pp={s.pp}; islands (0,1),(2,3); "
                + "; ".join(f"{lf}: " + ", ".join(v) for lf, v in leaves.items()))


def small_instance(rng: random.Random) -> Instance:
    n_leaves, per_leaf = rng.choice((2, 3)), rng.choice((2, 3))
    nodes = tuple(NodeInfo(name=f"n{i}", gpus=4, islands=((0, 1), (2, 3)), leaf=f"leaf-{i // per_leaf}",
                           spine="spine-0", node_id=f"{rng.getrandbits(64):016x}")
                  for i in range(n_leaves * per_leaf))
    busy = rng.uniform(0.1, 0.6)
    used = {n.name: {g for g in range(4) if rng.random() < busy} for n in nodes}
    return Instance(nodes, used, JobShape(dp=rng.randint(1, 4), tp=rng.choice((1, 2)), pp=rng.choice((1, 2))))


class TooLong(Exception):
    pass


def exhaustive(inst: Instance, time_cap_s: float) -> tuple[float, tuple[int, int, int, int], int] | None:
    """(min cost, min lexicographic tuple, plans scored) over all valid placements; None if none.

    Raises TooLong past `time_cap_s`.
    """
    shape, k = inst.shape, inst.shape.tp
    room: dict[str, list[tuple[NodeInfo, tuple[int, ...]]]] = {}
    for n in inst.nodes:
        for isl in n.islands:
            avail = [g for g in isl if g not in inst.used.get(n.name, ())]
            room.setdefault(n.leaf, []).extend((n, tuple(avail[j * k:(j + 1) * k]))
                                                for j in range(len(avail) // k))
    leaves = sorted(room)
    cap = [len(room[lf]) for lf in leaves]
    groups = shape.dp * shape.pp
    if sum(cap) < groups:
        return None
    deadline = time.monotonic() + time_cap_s
    best: list = [float("inf"), (1 << 30,) * 4, 0]
    seq: list[int] = []
    count = [0] * len(leaves)

    def evaluate() -> None:
        nxt = [0] * len(leaves)
        slots = []
        for gi, li in enumerate(seq):
            node, gpus = room[leaves[li]][nxt[li]]
            nxt[li] += 1
            slots += [RankSlot(rank=gi * k + t, node=node.name, node_id=node.node_id, leaf=node.leaf,
                               gpus=(gpus[t],)) for t in range(k)]
        sc = score(PlacementPlan(slots=tuple(slots)), inst.nodes, shape, UNIT_TRAFFIC)
        best[0] = min(best[0], cost_of(sc))
        best[1] = min(best[1], lex_of(sc))
        best[2] += 1

    def dfs() -> None:
        if len(seq) == groups:
            evaluate()
            if time.monotonic() > deadline:
                raise TooLong
            return
        fresh: set[int] = set()
        for li in range(len(leaves)):
            if count[li] >= cap[li]:
                continue
            if count[li] == 0:
                if cap[li] in fresh:
                    continue
                fresh.add(cap[li])
            seq.append(li)
            count[li] += 1
            dfs()
            count[li] -= 1
            seq.pop()

    dfs()
    return best[0], best[1], best[2]


def optimality(n_instances: int, time_cap_s: float) -> None:
    """Draw random small instances until `n_instances` have an optimum above 0.

    Instances whose optimum is 0 (the job fits in one leaf) say little about the
    gap; they are still solved and counted, and a miss on one is logged.
    """
    rng = random.Random(SEED + 1)
    gaps_ours: list[float] = []
    gaps_pack: list[float] = []
    drawn = skipped = infeasible = refused = scored = 0
    optimal = lex_optimal = trivial = trivial_missed = 0
    misses: list[tuple[int, Instance, str]] = []  # (instance size, instance, what differs)
    t0 = time.monotonic()
    while len(gaps_ours) < n_instances and drawn < 100 * n_instances:
        inst = small_instance(rng)
        drawn += 1
        try:
            opt = exhaustive(inst, time_cap_s)
        except TooLong:
            skipped += 1
            continue
        ours = place(inst.nodes, inst.used, inst.shape)
        if opt is None:
            infeasible += 1
            if not isinstance(ours, Infeasible):
                raise SystemExit(f"place() placed a job exhaustive search calls infeasible: {inst.text()}")
            continue
        opt_cost, opt_lex, n = opt
        scored += n
        if isinstance(ours, Infeasible):
            refused += 1
            log(f"WEAKNESS: place() says infeasible ({ours.reason}) but a placement exists: {inst.text()}")
            continue
        so = score(ours, inst.nodes, inst.shape, UNIT_TRAFFIC)
        sp = score(must_plan(ray_pack(inst.nodes, inst.used, inst.shape), "PACK, small instance"),
                   inst.nodes, inst.shape, UNIT_TRAFFIC)
        c_ours, c_pack = cost_of(so), cost_of(sp)
        if c_ours < opt_cost - EPS or lex_of(so) < opt_lex:
            raise SystemExit(f"exhaustive search missed a better plan (bug in the bench): {inst.text()}")
        hit, lex_hit = c_ours <= opt_cost + EPS, lex_of(so) == opt_lex
        if not (hit and lex_hit):
            misses.append((sum(nd.gpus for nd in inst.nodes) * 100 + inst.shape.world_size, inst,
                           f"ours cost {c_ours:.3f} lex {lex_of(so)}, best cost {opt_cost:.3f} "
                           f"best lex {opt_lex}"))
        if opt_cost <= EPS:
            trivial += 1
            trivial_missed += not hit
            continue
        optimal += hit
        lex_optimal += lex_hit
        gaps_ours.append(100 * (c_ours - opt_cost) / max(opt_cost, EPS))
        gaps_pack.append(100 * (c_pack - opt_cost) / max(opt_cost, EPS))
    done = len(gaps_ours)
    log(f"optimality: {drawn} instances drawn in {time.monotonic() - t0:.1f}s ({scored} plans scored "
        f"exhaustively): {done} with optimum > 0, {trivial} with optimum 0, {infeasible} infeasible, "
        f"{skipped} skipped past the {time_cap_s:g}s cap")
    log(f"on the {done}: ours cost-optimal on {optimal}, lexicographically optimal on {lex_optimal}; "
        f"on the {trivial} with optimum 0: ours missed {trivial_missed}; refused feasible jobs: {refused}")
    mean_ours = sum(gaps_ours) / max(1, done)
    mean_pack = sum(gaps_pack) / max(1, done)
    log(f"gap: ours mean {mean_ours:.2f}% max {max(gaps_ours, default=0):.2f}%; "
        f"PACK mean {mean_pack:.2f}% max {max(gaps_pack, default=0):.2f}%")
    for _, inst, detail in sorted(misses, key=lambda m: m[0])[:3]:
        log(f"not optimal: {detail}; {inst.text()}")
    report("optimality_gap", "%", mean_ours, mean_pack, 5)


# -- 5: one scheduling cycle --------------------------------------------------------------

PREFERRED_POLICIES = ("gang", "fifo")  # best first; whichever exists in POLICIES at run time

# (dp, tp, pp) of the queued jobs, with weights by job count: mostly one-node and
# small multi-node jobs, a tail of 128- and 256-GPU pipelines.
QUEUE_MIX = (((1, 1, 1), 0.10), ((2, 1, 1), 0.05), ((1, 2, 1), 0.05), ((1, 4, 1), 0.05),
             ((4, 1, 1), 0.05), ((1, 8, 1), 0.20), ((2, 8, 1), 0.15), ((4, 8, 1), 0.10),
             ((2, 8, 2), 0.05), ((8, 8, 1), 0.07), ((2, 8, 4), 0.05), ((4, 8, 4), 0.05),
             ((8, 8, 4), 0.03))


# Priorities of queued and running jobs alike; every job is in the queue `default`,
# the one queue a Snapshot has unless a queue table is given.
PRIORITIES = (10, 50, 50, 90)


def active_records(nodes: tuple[NodeInfo, ...], jobs: list[list[tuple[str, int]]],
                   rng: random.Random) -> tuple[JobRecord, ...]:
    by_name = {n.name: n for n in nodes}
    out = []
    for i, job in enumerate(jobs):
        placement = tuple(PlacedRank(rank=r, node=name, node_id=by_name[name].node_id,
                                     leaf=by_name[name].leaf, gpu=g, gpus=(g,))
                          for r, (name, g) in enumerate(job))
        out.append(JobRecord(id=f"run-{i:04d}", name=f"run-{i:04d}",
                             spec={"parallel": {"data_parallel_size": len(job)}}, state=JobState.RUNNING,
                             priority=rng.choice(PRIORITIES), world_size=len(job), gpus=len(job),
                             created_at=float(i), started_at=float(i), placement=placement))
    return tuple(out)


def queued_records(n: int, rng: random.Random) -> tuple[JobRecord, ...]:
    shapes, weights = zip(*QUEUE_MIX, strict=True)
    out = []
    for i in range(n):
        dp, tp, pp = rng.choices(shapes, weights)[0]
        out.append(JobRecord(
            id=f"q-{i:04d}", name=f"q-{i:04d}",
            spec={"parallel": {"data_parallel_size": dp, "tensor_parallel_size": tp,
                               "pipeline_parallel_size": pp}},
            priority=rng.choice(PRIORITIES),
            world_size=dp * tp * pp, gpus=dp * tp * pp, created_at=10_000.0 + i))
    return tuple(out)


def schedule_cycle(runs: int) -> None:
    name = next(p for p in PREFERRED_POLICIES if p in policies.POLICIES)
    log(f"policies available: {sorted(policies.POLICIES)}; ours = {name!r}, baseline = 'fifo'"
        + (" (no 'gang' policy yet: baseline and ours are the same policy)" if name == "fifo" else ""))
    nodes = make_cluster(NVSWITCH)
    jobs = occupy(nodes, 0.5, random.Random(SEED))
    snap = Snapshot(nodes=nodes, queued=queued_records(1000, random.Random(SEED + 2)),
                    active=active_records(nodes, jobs, random.Random(SEED + 3)))
    ours_policy, fifo = make_policy(name), make_policy("fifo")
    ours_ms, fifo_ms = [], []
    decided: dict[str, list] = {}
    for _ in range(runs):  # interleaved
        ours_ms.append(timed_ms(lambda: decided.__setitem__("ours", ours_policy.decide(snap))))
        fifo_ms.append(timed_ms(lambda: decided.__setitem__("fifo", fifo.decide(snap))))
    for who, ds in decided.items():
        kinds: dict[str, int] = {}
        for d in ds:
            kinds[type(d).__name__] = kinds.get(type(d).__name__, 0) + 1
        gpus = sum(len(s.gpus) for d in ds if isinstance(d, policies.Admit) for s in d.plan.slots)
        log(f"{who}: {len(ds)} decisions {kinds}, {gpus} GPUs admitted")
    log(f"cycle: ours median {median(ours_ms):.1f} ms {[round(x) for x in ours_ms]}, "
        f"fifo median {median(fifo_ms):.1f} ms {[round(x) for x in fifo_ms]}")
    report("schedule_cycle_ms", "ms", median(ours_ms), median(fifo_ms), 200)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=21, help="timed place() calls (default 21)")
    ap.add_argument("--instances", type=int, default=30, help="small instances for optimality_gap")
    ap.add_argument("--time-cap", type=float, default=5.0, help="exhaustive search cap per instance, s")
    ap.add_argument("--cycles", type=int, default=5, help="timed scheduling cycles per policy")
    args = ap.parse_args()
    t0 = time.monotonic()
    big_job(args.repeats)
    optimality(args.instances, args.time_cap)
    schedule_cycle(args.cycles)
    log(f"done in {time.monotonic() - t0:.0f}s")


if __name__ == "__main__":
    main()
