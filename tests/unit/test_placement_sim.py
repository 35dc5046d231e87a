"""bench/placement_sim.py's re-implementation of Ray's placement-group scheduling, on its own.

tests/integration/test_ray_placement_sim.py holds it against a real Ray cluster;
these pin the pieces without one."""

from __future__ import annotations

import random

import pytest

from bench.placement_sim import (
    PACK,
    SPREAD,
    RayNode,
    bundle_order,
    cxx_sort,
    least_resource_score,
    ray_plan,
    ray_train_ranks,
    schedule_pg,
)
from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.placement.solver import JobShape

ONE = {"GPU": 1.0}


def test_cxx_sort_sorts():
    rng = random.Random(1)
    for n in range(0, 300, 7):
        xs = [rng.randint(0, 4) for _ in range(n)]
        assert cxx_sort(xs, lambda a, b: a > b) == sorted(xs, reverse=True)


def test_cxx_sort_permutes_equal_items_as_libstdcxx_does():
    # What real Ray 2.60 did with 20 and 24 equal bundles (the integration test's
    # pack-empty-20-permuted and pack-24-fills-all cases pass only with this order).
    assert cxx_sort(range(20), lambda a, b: False) == [10, *range(19, 10, -1), 0, *range(9, 0, -1)]
    assert cxx_sort(range(24), lambda a, b: False) == [12, *range(23, 12, -1), 0, *range(11, 0, -1)]
    assert cxx_sort(range(16), lambda a, b: False) == list(range(16))  # insertion sort only: stable


def test_bundles_go_most_gpus_first_then_most_cpus():
    bundles = [{"GPU": 1, "CPU": 1}, {"GPU": 2}, {"GPU": 1, "CPU": 4}, {"CPU": 8}, {"GPU": 2, "CPU": 2}]
    assert bundle_order(bundles) == [4, 1, 2, 0, 3]


def test_least_resource_score():
    assert least_resource_score({"GPU": 10_000}, {"GPU": 80_000}) == pytest.approx(7 / 8)
    assert least_resource_score({"GPU": 10_000}, {"GPU": 0}) == -1.0
    assert least_resource_score({"GPU": 10_000, "CPU": 10_000}, {"GPU": 40_000, "CPU": 20_000}) \
        == pytest.approx(0.75 + 0.5)


def nodes(**free: float) -> list[RayNode]:
    return [RayNode(name, {"GPU": float(g)}) for name, g in free.items()]


def test_pack_fills_the_emptiest_node_first_and_spills_to_the_next_emptiest():
    assert schedule_pg(PACK, [ONE] * 6, nodes(a=3, b=6, c=5, d=4)) == ["b"] * 6
    assert sorted(schedule_pg(PACK, [ONE] * 9, nodes(a=3, b=6, c=5, d=4))) == ["b"] * 6 + ["c"] * 3
    assert schedule_pg(PACK, [ONE] * 19, nodes(a=3, b=6, c=5, d=4)) is None  # 18 free: pending


def test_spread_takes_a_new_node_per_bundle_then_the_emptiest_used_one():
    got = schedule_pg(SPREAD, [ONE] * 5, nodes(a=1, b=8, c=0, d=4))
    assert got == ["b", "d", "a", "b", "b"]  # b 8 -> 7 -> 6 beats d's 3


def test_ties_are_handed_to_the_chooser_in_node_order():
    seen = []

    def choose(tied, bundle):
        seen.append((tuple(tied), bundle))
        return tied[-1]

    assert schedule_pg(PACK, [ONE] * 2, nodes(a=8, b=4, c=8), choose) == ["c", "c"]
    assert seen == [(("a", "c"), 0)]


def test_ray_plan_ranks_follow_ray_train():
    cluster = tuple(NodeInfo(name=f"n{i}", gpus=8, islands=((0, 1, 2, 3), (4, 5, 6, 7)), leaf="leaf-0",
                             node_id=f"{i:02x}") for i in range(4))
    used = {"n0": {0, 5}}
    # 24 bundles: PACK takes the three empty nodes (ties in node-id order: n1, n2, n3) and
    # leaves the partly used n0 alone; sorted positions 0-7, 8-15, 16-23 hold bundles
    # {12, 17..23}, {0, 9..11, 13..16}, {1..8}. Ray Train orders nodes by their first
    # bundle: bundle 0 is on n2, bundle 1 on n3, bundle 12 on n1.
    plan = ray_plan(PACK, cluster, used, JobShape(dp=6, tp=4))
    assert [s.node for s in plan.slots] == ["n2"] * 8 + ["n3"] * 8 + ["n1"] * 8
    assert [s.gpus[0] for s in plan.slots] == list(range(8)) * 3
    # rank i = bundle i instead: the same nodes, scattered by libstdc++'s order.
    by_bundle = ray_plan(PACK, cluster, used, JobShape(dp=6, tp=4), ranks="bundle")
    assert [s.node for s in by_bundle.slots] == (
        ["n2"] + ["n3"] * 8 + ["n2"] * 3 + ["n1"] + ["n2"] * 4 + ["n1"] * 7)


def test_ray_train_ranks_group_by_first_appearance():
    assert ray_train_ranks(["b", "a", "b", "c", "a"]) == [0, 2, 1, 4, 3]
