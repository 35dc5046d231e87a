"""Placement and FIFO admission, table-driven over small topologies."""

import pytest

from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.jobs.state import JobRecord, JobState, PlacedRank
from kuangchao.platform.placement.solver import Infeasible, JobShape, PlacementPlan, RankSlot, place
from kuangchao.platform.scheduling.policies import Admit, FifoPolicy, Snapshot, Wait


def node(name, gpus=4, islands=((0, 1), (2, 3)), leaf="leaf-0", alive=True) -> NodeInfo:
    return NodeInfo(name=name, gpus=gpus, islands=islands, leaf=leaf, node_id=f"id-{name}",
                    alive=alive)


def job(jid, dp=1, tp=1, created=0.0, state=JobState.QUEUED, placement=()) -> JobRecord:
    return JobRecord(id=jid, name=jid, spec={"parallel": {"data_parallel_size": dp,
                                                          "tensor_parallel_size": tp}},
                     state=state, created_at=created, placement=placement)


CLUSTER = (node("n0"), node("n1", leaf="leaf-1"))


@pytest.mark.parametrize("shape,used,expect", [
    (JobShape(dp=2), {}, [("n0", (0,)), ("n0", (1,))]),
    (JobShape(dp=2, tp=2), {}, [("n0", (0,)), ("n0", (1,)), ("n0", (2,)), ("n0", (3,))]),
    # n0 has one GPU left in each island: a tp=2 group must go to n1.
    (JobShape(dp=1, tp=2), {"n0": {0, 2}}, [("n1", (0,)), ("n1", (1,))]),
    # best fit: the island with exactly one free GPU is used first
    (JobShape(dp=1), {"n0": {0}}, [("n0", (1,))]),
])
def test_place_puts_ranks_in_plan_order_when_capacity_allows(shape, used, expect):
    plan = place(CLUSTER, used, shape)
    assert isinstance(plan, PlacementPlan)
    assert [(s.node, s.gpus) for s in plan.slots] == expect
    assert [s.rank for s in plan.slots] == list(range(shape.world_size))


def test_place_never_splits_a_tp_group_across_islands():
    plan = place(CLUSTER, {}, JobShape(dp=4, tp=2))
    assert isinstance(plan, PlacementPlan)
    by_node = {n.name: n for n in CLUSTER}
    for g in range(4):
        group = plan.slots[g * 2:(g + 1) * 2]
        assert len({s.node for s in group}) == 1
        island = next(i for i in by_node[group[0].node].islands if group[0].gpus[0] in i)
        assert all(s.gpus[0] in island for s in group)


@pytest.mark.parametrize("shape,used,reason", [
    (JobShape(dp=9), {}, "needs 9 GPUs, the cluster has 8"),
    (JobShape(dp=4), {"n0": {0, 1, 2}, "n1": {0, 1}}, "needs 4 GPUs, 3 of 8 are free"),
    (JobShape(dp=1, tp=2), {"n0": {0, 2}, "n1": {1, 3}}, "fragmented"),
])
def test_place_explains_why_when_nothing_fits(shape, used, reason):
    out = place(CLUSTER, used, shape)
    assert isinstance(out, Infeasible) and reason in out.reason


def test_place_skips_dead_nodes():
    out = place((node("n0", alive=False), node("n1")), {}, JobShape(dp=2))
    assert isinstance(out, PlacementPlan) and {s.node for s in out.slots} == {"n1"}


def test_place_is_deterministic_for_the_same_input():
    assert place(CLUSTER, {"n0": {1}}, JobShape(dp=3)) == place(CLUSTER, {"n0": {1}}, JobShape(dp=3))


def test_fifo_admits_in_arrival_order_and_blocks_behind_a_job_that_does_not_fit():
    running = job("r", dp=6, state=JobState.RUNNING, placement=tuple(
        PlacedRank(rank=i, node=f"n{i // 4}", node_id="", leaf="", gpu=i % 4, gpus=(i % 4,))
        for i in range(6)))
    snap = Snapshot(nodes=CLUSTER, active=(running,),
                    queued=(job("small-late", dp=1, created=3), job("big", dp=4, created=1),
                            job("fits", dp=1, created=0)))
    decisions = {d.job_id: d for d in FifoPolicy().decide(snap)}
    assert isinstance(decisions["fits"], Admit)
    assert isinstance(decisions["big"], Wait) and "needs 4 GPUs, 1 of 8 are free" in decisions["big"].reason
    assert isinstance(decisions["small-late"], Wait) and "behind job big" in decisions["small-late"].reason


def test_fifo_counts_gpus_admitted_earlier_in_the_same_cycle():
    snap = Snapshot(nodes=CLUSTER, active=(), queued=(job("a", dp=6, created=0),
                                                      job("b", dp=4, created=1)))
    a, b = FifoPolicy().decide(snap)
    assert isinstance(a, Admit) and isinstance(b, Wait)


# -- topology rules on larger clusters ------------------------------------
from kuangchao.platform.placement.score import Traffic, score  # noqa: E402


def cluster(leaves: int, nodes_per_leaf: int, gpus: int = 8, island: int = 4,
            spines: int = 1) -> tuple[NodeInfo, ...]:
    isl = tuple(tuple(range(i, i + island)) for i in range(0, gpus, island))
    return tuple(
        NodeInfo(name=f"n{lf:02d}-{i:02d}", gpus=gpus, islands=isl, leaf=f"leaf-{lf:02d}",
                 spine=f"spine-{lf % spines}", node_id=f"id{lf}-{i}")
        for lf in range(leaves) for i in range(nodes_per_leaf))


def test_pipelines_stay_inside_one_leaf_when_capacity_allows():
    nodes = cluster(leaves=4, nodes_per_leaf=2)
    shape = JobShape(dp=4, tp=4, pp=4)  # each pipeline needs 16 GPUs = one leaf
    plan = place(nodes, {}, shape)
    s = score(plan, nodes, shape)
    assert s.tp_groups_split == 0 and s.pipelines_across_leaves == 0 and s.leaves_used == 4


def test_dp_replicas_use_the_fewest_leaves_best_fit():
    nodes = cluster(leaves=3, nodes_per_leaf=2)
    used = {"n00-00": set(range(8)), "n00-01": {0}}  # leaf-00 nearly full; 01 and 02 empty
    shape = JobShape(dp=4, tp=4)
    plan = place(nodes, used, shape)
    assert {s.leaf for s in plan.slots} == {"leaf-01"}
    assert score(plan, nodes, shape).cross_leaf_ring_edges == 0


def test_ring_crosses_each_leaf_boundary_once_when_replicas_span_leaves():
    nodes = cluster(leaves=4, nodes_per_leaf=1)
    shape = JobShape(dp=4, tp=4)  # 16 GPUs over two 8-GPU leaves
    plan = place(nodes, {}, shape)
    s = score(plan, nodes, shape)
    assert s.leaves_used == 2
    assert s.cross_leaf_ring_edges == 2 * shape.tp  # out and back, on each of the tp rings


def test_leaves_under_one_spine_are_preferred():
    # leaf-00 and leaf-02 hang off spine-0, leaf-01 and leaf-03 off spine-1.
    nodes = cluster(leaves=4, nodes_per_leaf=1, island=8, spines=2)
    used = {"n00-00": {0, 1, 2, 3}}  # spine-0 has room for one 8-way group only
    plan = place(nodes, used, JobShape(dp=2, tp=8))
    assert {s.leaf for s in plan.slots} == {"leaf-01", "leaf-03"}


def test_pipelines_straddle_leaves_only_when_no_leaf_can_hold_one():
    nodes = cluster(leaves=2, nodes_per_leaf=1)
    shape = JobShape(dp=1, tp=4, pp=4)  # 16 GPUs, each leaf has 8
    plan = place(nodes, {}, shape)
    assert isinstance(plan, PlacementPlan)
    assert score(plan, nodes, shape).pipelines_across_leaves == 1


def test_tp_group_larger_than_any_island_is_infeasible_with_reason():
    out = place(cluster(1, 2), {}, JobShape(dp=1, tp=8))
    assert isinstance(out, Infeasible) and "largest island has 4" in out.reason


def test_best_fit_keeps_a_whole_node_free_for_later_jobs():
    nodes = cluster(leaves=1, nodes_per_leaf=2)
    used = {"n00-00": {0, 1, 2, 3}}
    plan = place(nodes, used, JobShape(dp=1, tp=4))
    assert plan.slots[0].node == "n00-00"  # fills the half-used node, not the empty one
    later = place(nodes, used | {"n00-00": set(range(8))}, JobShape(dp=1, tp=8, gpus_per_rank=1))
    assert isinstance(later, Infeasible)  # 4-GPU islands: an 8-way TP never fits
    assert isinstance(place(nodes, used | {"n00-00": set(range(8))}, JobShape(dp=2, tp=4)),
                      PlacementPlan)


def test_score_counts_cross_leaf_bytes_from_traffic():
    nodes = cluster(leaves=2, nodes_per_leaf=1)
    shape = JobShape(dp=4, tp=4)
    plan = place(nodes, {}, shape)
    s = score(plan, nodes, shape, Traffic(grad_bytes=1000.0))
    per_edge = 2 * 3 / 4 * 1000.0 / 4
    assert s.cross_leaf_bytes == s.cross_leaf_ring_edges * per_edge > 0


def test_a_single_rank_with_more_gpus_than_an_island_takes_a_whole_node():
    nodes = cluster(leaves=1, nodes_per_leaf=2)  # 8 GPUs per node in islands of 4
    plan = place(nodes, {"n00-00": {0}}, JobShape(dp=1, tp=1, gpus_per_rank=8))
    assert isinstance(plan, PlacementPlan) and plan.slots[0] == RankSlot(
        rank=0, node="n00-01", node_id="id0-1", leaf="leaf-00", gpus=tuple(range(8)))
    out = place(nodes, {}, JobShape(dp=1, gpus_per_rank=9))
    assert isinstance(out, Infeasible) and "largest node has 8" in out.reason


def test_traffic_decides_between_whole_pipelines_and_fewer_leaves():
    # Two leaves of two 4-GPU nodes; GPU 0 is busy on n00-00 and on n01-00.
    nodes = cluster(leaves=2, nodes_per_leaf=2, gpus=4, island=4)
    used = {"n00-00": {0}, "n01-00": {0}}
    shape = JobShape(dp=4, pp=2)
    whole = place(nodes, used, shape)  # no traffic: pipelines stay whole
    assert score(whole, nodes, shape).pipelines_across_leaves == 0
    heavy = Traffic(grad_bytes=1e9, activation_bytes=1.0)
    packed = place(nodes, used, shape, heavy)
    assert score(packed, nodes, shape, heavy).cross_leaf_bytes < score(whole, nodes, shape,
                                                                       heavy).cross_leaf_bytes
    light = Traffic(grad_bytes=1.0, activation_bytes=1e9)
    assert score(place(nodes, used, shape, light), nodes, shape).pipelines_across_leaves == 0
