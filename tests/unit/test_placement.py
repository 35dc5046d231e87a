"""Placement and FIFO admission, table-driven over small topologies."""

import pytest

from kuangchao.platform.placement import Infeasible, JobShape, PlacementPlan, place
from kuangchao.platform.policies import Admit, FifoPolicy, Snapshot, Wait
from kuangchao.platform.state import JobRecord, JobState, PlacedRank
from kuangchao.platform.topology import NodeInfo


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
