"""The kept free-capacity index: placing over it, after any GPUs were taken, gives the
plan `place()` gives from scratch on the same used GPUs."""

from __future__ import annotations

import random

import pytest

from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.placement.index import FreeIndex
from kuangchao.platform.placement.solver import JobShape, Traffic, place, place_on

TYPES = (None, "h100-80gb", "a100-80gb")


def random_cluster(rng: random.Random, typed: bool) -> tuple[NodeInfo, ...]:
    islands = rng.choice((((0, 1, 2, 3, 4, 5, 6, 7),), ((0, 1, 2, 3), (4, 5, 6, 7))))
    per_leaf = rng.choice((2, 3, 4))
    return tuple(NodeInfo(name=f"n{i:02d}", gpus=8, islands=islands, leaf=f"leaf-{i // per_leaf}",
                          spine=f"spine-{i // (per_leaf * 2)}", node_id=f"id{i}",
                          alive=rng.random() > 0.1,
                          gpu_type=rng.choice(TYPES[1:]) if typed else None)
                 for i in range(rng.randint(4, 16)))


def random_used(rng: random.Random, nodes, share: float) -> dict[str, set[int]]:
    return {n.name: {g for g in range(n.gpus) if rng.random() < share} for n in nodes}


def random_shape(rng: random.Random, typed: bool) -> JobShape:
    types = tuple(rng.sample(TYPES[1:], rng.randint(1, 2))) if typed and rng.random() < 0.7 else ()
    return JobShape(dp=rng.randint(1, 6), tp=rng.choice((1, 2, 4, 8)), pp=rng.choice((1, 1, 2)),
                    gpus_per_rank=rng.choice((1, 1, 1, 2)), gpu_types=types,
                    heterogeneous=rng.random() < 0.3)


@pytest.mark.parametrize("seed", range(40))
def test_placing_over_a_kept_index_matches_a_fresh_solve(seed):
    rng = random.Random(seed)
    typed = seed % 2 == 1
    nodes = random_cluster(rng, typed)
    used = random_used(rng, nodes, rng.uniform(0.0, 0.5))
    index = FreeIndex(nodes, used)
    for _ in range(6):
        shape = random_shape(rng, typed)
        traffic = Traffic(grad_bytes=rng.choice((0.0, 1e9)), activation_bytes=1e8) \
            if rng.random() < 0.5 else None
        caps = {"h100-80gb": rng.randint(0, 32)} if typed and rng.random() < 0.3 else None
        assert place_on(index, shape, traffic, caps) == place(nodes, used, shape, traffic, caps)
        # Some GPUs go (an admission, a hold): both sides learn of it.
        taken = {n.name: {g for g in range(n.gpus) if rng.random() < 0.2}
                 for n in rng.sample(nodes, min(3, len(nodes)))}
        index.take(taken)
        for name, ids in taken.items():
            used.setdefault(name, set()).update(ids)


def test_take_counts_a_gpu_taken_twice_once():
    nodes = (NodeInfo(name="a", gpus=8, islands=((0, 1, 2, 3), (4, 5, 6, 7)), leaf="l0"),)
    index = FreeIndex(nodes, {})
    shape = JobShape(dp=1, tp=4)
    index.take({"a": {0, 1}})
    index.take({"a": {1}})
    assert place_on(index, JobShape(dp=1, tp=4)) == place(nodes, {"a": {0, 1}}, shape)
    assert index.free_in(index.scope(index.pools(()))) == 6
