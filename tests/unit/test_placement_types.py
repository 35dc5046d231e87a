"""GPU types in placement (issue 25): the type filter, one pool per one-type job,
TP groups of one type in a mixed job, pipelines of one type, per-type quota room,
and the tensor-parallel-group-versus-island check done at submission."""

import random

import pytest

from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.placement.pools import (
    Ahead,
    capacity_problem,
    island_problem,
    pools_of,
    queue_ahead,
    speed,
    wait_pool,
)
from kuangchao.platform.placement.solver import Infeasible, JobShape, PlacementPlan, place

H100, A100 = "h100-80gb", "a100-80gb"


def node(name, gpu_type, gpus=4, island=2, leaf="leaf-0") -> NodeInfo:
    isl = tuple(tuple(range(i, i + island)) for i in range(0, gpus, island))
    return NodeInfo(name=name, gpus=gpus, islands=isl, leaf=leaf, node_id=f"id-{name}",
                    gpu_type=gpu_type)


# Two H100 nodes, two A100 nodes and one untyped node, 4 GPUs each in islands of 2.
MIXED = (node("h0", H100), node("h1", H100), node("a0", A100), node("a1", A100),
         node("u0", None))
TYPE = {n.name: n.gpu_type for n in MIXED}


def types_of(plan: PlacementPlan) -> list[str | None]:
    return [TYPE[s.node] for s in plan.slots]


def tp_groups(plan: PlacementPlan, tp: int) -> list[set]:
    return [{TYPE[s.node] for s in plan.slots[i:i + tp]} for i in range(0, len(plan.slots), tp)]


# -- the type filter ------------------------------------------------------------------

@pytest.mark.parametrize("hetero", [False, True])
@pytest.mark.parametrize("dp, tp, pp", [(1, 1, 1), (4, 1, 1), (2, 2, 1), (1, 2, 2), (8, 1, 1)])
def test_a_job_asking_for_one_type_never_lands_on_another(dp, tp, pp, hetero):
    shape = JobShape(dp=dp, tp=tp, pp=pp, gpu_types=(A100,), heterogeneous=hetero)
    plan = place(MIXED, {}, shape)
    assert isinstance(plan, PlacementPlan) and set(types_of(plan)) == {A100}
    # With the A100s taken it waits, although H100 and untyped GPUs are free.
    busy = place(MIXED, {"a0": {0, 1, 2, 3}, "a1": {0, 1, 2, 3}}, shape)
    assert isinstance(busy, Infeasible)
    assert busy.reason.startswith(f"needs {dp * tp * pp} GPUs, 0 of 8 in the {A100} pool are free")


def test_a_type_missing_from_the_cluster_is_named_with_the_types_there():
    out = place(MIXED, {}, JobShape(dp=1, gpu_types=("h200-141gb",)))
    assert out == Infeasible("no live node has GPU type h200-141gb (the live nodes have "
                             "a100-80gb, h100-80gb, untyped); list one of those in "
                             "resources.gpu_types")


def test_an_untyped_node_serves_only_jobs_that_list_no_type():
    typed = place(MIXED, {}, JobShape(dp=20, gpu_types=(H100, A100), heterogeneous=True))
    assert typed == Infeasible(f"needs 20 GPUs, the {H100}/{A100} pools has 16")
    anyone = place(MIXED, {}, JobShape(dp=20, heterogeneous=True))
    assert isinstance(anyone, PlacementPlan) and None in types_of(anyone)


def test_a_cpu_only_job_keeps_to_its_listed_types():
    plan = place(MIXED, {}, JobShape(dp=3, gpus_per_rank=0, gpu_types=(A100,)))
    assert isinstance(plan, PlacementPlan) and set(types_of(plan)) == {A100}


# -- one-type jobs: one pool ----------------------------------------------------------

@pytest.mark.parametrize("types, used, expect", [
    ((A100, H100), {}, A100),                  # the order the user listed
    ((H100, A100), {}, H100),
    ((), {}, H100),                            # none listed: the fastest
    ((A100, H100), {"a0": {0, 1}}, H100),      # the first choice has 6 free, the job needs 8
])
def test_a_one_type_job_goes_to_the_first_pool_that_fits_now(types, used, expect):
    plan = place(MIXED, used, JobShape(dp=8, gpu_types=types))
    assert isinstance(plan, PlacementPlan) and set(types_of(plan)) == {expect}


def test_a_one_type_job_never_mixes_even_when_only_a_mix_would_fit():
    used = {"h0": {0, 1}, "a0": {0, 1}}  # 6 free in each pool, 12 together
    out = place(MIXED, used, JobShape(dp=8, gpu_types=(H100, A100)))
    assert out == Infeasible(
        "no single GPU type can hold all ranks: needs 8 GPUs, 6 of 8 in the h100-80gb pool are "
        "free; needs 8 GPUs, 6 of 8 in the a100-80gb pool are free")
    mixed = place(MIXED, used, JobShape(dp=8, gpu_types=(H100, A100), heterogeneous=True))
    assert isinstance(mixed, PlacementPlan) and set(types_of(mixed)) == {H100, A100}


def test_an_untyped_cluster_places_as_before():
    plain = tuple(node(f"n{i}", None) for i in range(3))
    for shape in (JobShape(dp=6), JobShape(dp=3, tp=2), JobShape(dp=2, pp=3)):
        assert place(plain, {}, shape) == place(plain, {}, JobShape(shape.dp, shape.tp, shape.pp))
    assert place(plain, {}, JobShape(dp=13)) == Infeasible("needs 13 GPUs, the cluster has 12")


# -- mixed jobs ----------------------------------------------------------------------

def test_a_mixed_jobs_tp_groups_are_each_one_type():
    placed = 0
    for seed in range(40):
        rng = random.Random(seed)
        # Islands of 2 and 4 on nodes of both types; a random part of each node is in use.
        cluster = tuple(node(f"{t[0]}{i}", t, gpus=8, island=rng.choice((2, 4)))
                        for t in (H100, A100) for i in range(3))
        used = {n.name: set(rng.sample(range(8), rng.randint(0, 4))) for n in cluster}
        tp = rng.choice((2, 4))
        plan = place(cluster, used, JobShape(dp=rng.randint(1, 3), tp=tp, pp=rng.choice((1, 2)),
                                             heterogeneous=True))
        if isinstance(plan, Infeasible):
            continue
        placed += 1
        types = {n.name: n.gpu_type for n in cluster}
        for i in range(0, len(plan.slots), tp):
            group = plan.slots[i:i + tp]
            assert len({types[s.node] for s in group}) == 1, (seed, group)
            assert len({s.node for s in group}) == 1  # the reason: one island of one node
    assert placed >= 30  # the rule was exercised, not skipped


def test_some_mixed_jobs_do_mix_and_still_keep_tp_groups_whole():
    # One free island of 2 on h0 and one on a0: only a mix of types holds two groups.
    used = {"h0": {0, 1}, "h1": {0, 1, 2, 3}, "a0": {0, 1}, "a1": {0, 1, 2, 3}}
    plan = place(MIXED[:4], used, JobShape(dp=2, tp=2, heterogeneous=True))
    assert isinstance(plan, PlacementPlan) and set(types_of(plan)) == {H100, A100}
    assert all(len(g) == 1 for g in tp_groups(plan, 2))


def test_a_mixed_pipeline_takes_its_stages_from_one_type_when_capacity_allows():
    # One GPU in use on each node: by best fit alone the slots run a, a, a, h, h, h,
    # and the second pipeline would pair an A100 stage with an H100 one.
    cluster = (node("h", H100, island=1), node("a", A100, island=1))
    used = {"h": {0}, "a": {0}}
    two = place(cluster, used, JobShape(dp=2, pp=2, heterogeneous=True))
    assert isinstance(two, PlacementPlan)
    kinds = [n.gpu_type for s in two.slots for n in cluster if n.name == s.node]
    assert kinds == [H100, H100, A100, A100]  # each pipeline one type; the faster first
    # When only a mix fits, one pipeline mixes; the others still do not.
    three = place(cluster, used, JobShape(dp=3, pp=2, heterogeneous=True))
    kinds = [n.gpu_type for s in three.slots for n in cluster if n.name == s.node]
    assert [len(set(kinds[i:i + 2])) for i in range(0, 6, 2)] == [1, 1, 2]


# -- per-type quota room -------------------------------------------------------------

def test_per_type_room_bounds_each_type():
    shape = JobShape(dp=12, gpu_types=(H100, A100), heterogeneous=True)
    plan = place(MIXED, {}, shape, caps={H100: 4})
    assert isinstance(plan, PlacementPlan) and types_of(plan).count(H100) == 4
    assert place(MIXED, {}, shape, caps={H100: 2, A100: 8}) == Infeasible(
        "needs 12 groups of 1 GPUs; the queue's per-type GPU quota leaves room for 10 in the "
        "h100-80gb/a100-80gb pools")
    one = place(MIXED, {}, JobShape(dp=4, gpu_types=(H100, A100)), caps={H100: 2})
    assert isinstance(one, PlacementPlan) and set(types_of(one)) == {A100}


# -- pools ---------------------------------------------------------------------------

def test_pools_come_in_the_jobs_order_of_preference():
    assert [p.name for p in pools_of(MIXED)] == [H100, A100, "untyped"]  # fastest first
    assert [p.name for p in pools_of(MIXED, (A100, H100))] == [A100, H100]
    assert speed(H100) > speed(A100) > speed(None) == 0


def test_the_pool_to_wait_for_has_the_shortest_queue_ahead_then_the_fewest_in_use():
    h, a = pools_of(MIXED, (H100, A100))
    ahead = [Ahead(6, (H100,)), Ahead(4, ()), Ahead(100, (A100,), pool=H100)]
    assert (queue_ahead(h, ahead), queue_ahead(a, ahead)) == (6 + 4 + 8, 4)
    assert wait_pool([h, a], ahead, {}) is a
    # An equal queue ahead: the pool with fewer GPUs in use; equal again: preference.
    assert wait_pool([h, a], [], {"h0": {0, 1, 2}, "a1": {0}}) is a
    assert wait_pool([h, a], [], {}) is h


def test_capacity_problem_names_the_pool_a_one_type_job_could_never_fill():
    assert capacity_problem(MIXED, (), False, 8) is None
    assert capacity_problem(MIXED, (), False, 9) == (
        f"needs 9 GPUs of one type; the largest pool ({H100}) has 8 (set "
        "resources.heterogeneous: true to mix types)")
    assert capacity_problem(MIXED, (), True, 20) is None
    assert capacity_problem(MIXED, (), True, 21) == "needs 21 GPUs, the cluster has 20"
    plain = (node("n0", None),)
    assert capacity_problem(plain, (), False, 5) == "needs 5 GPUs, the cluster has 4"


# -- the submission check: a tensor-parallel group against the islands ----------------

def test_a_tp_group_larger_than_every_island_of_its_types_is_refused():
    cluster = (node("h0", H100, gpus=8, island=8), node("a0", A100, gpus=8, island=4))
    field, msg = island_problem(cluster, (A100,), tp=8, gpus_per_rank=1)
    assert field == "parallel.tensor_parallel_size"
    assert msg.startswith("8 GPUs per tensor-parallel group (8 x 1 GPUs per rank) do not fit the "
                          "largest single-type NVLink island (4 GPUs on a100-80gb nodes); lower "
                          "parallel.tensor_parallel_size to 4 or less")
    assert island_problem(cluster, (A100, H100), tp=8, gpus_per_rank=1) is None
    assert island_problem(cluster, (), tp=8, gpus_per_rank=1) is None
    assert island_problem(cluster, (), tp=4, gpus_per_rank=4)[0] == "parallel.tensor_parallel_size"
    assert island_problem((), (A100,), tp=64, gpus_per_rank=1) is None  # no node view yet


def test_a_single_rank_needs_its_gpus_on_one_node_of_its_types():
    cluster = (node("h0", H100, gpus=8, island=4), node("a0", A100, gpus=4, island=2))
    assert island_problem(cluster, (), tp=1, gpus_per_rank=8) is None
    assert island_problem(cluster, (A100,), tp=1, gpus_per_rank=8) == (
        "parallel.gpus_per_rank", "a rank needs 8 GPUs on one node; the largest node "
        "(a100-80gb) has 4; lower parallel.gpus_per_rank to 4 or less")
