"""bench/placement_sim.py's re-implementation of Ray's PACK and SPREAD, against Ray itself.

One small fake cluster for the module (`ray.cluster_utils.Cluster`: a head with
no GPUs and four raylets with 8, 8, 6 and 4 fake GPUs and 4, 2, 4, 3 CPUs). Each
case makes some nodes partly busy (placement groups pinned to a node through a
per-node custom resource, or actors holding GPUs), reads the GCS's view of every
node's free GPUs and CPUs, creates one real placement group and reads where Ray
put each bundle. `placement_sim.disagreement` then replays the simulation on the
view it read, following Ray wherever several nodes tie for best (Ray breaks those
by hash order) and requiring every other decision to be the same.

About 25 s on 2 cores, most of it the cluster coming up.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `bench`

from bench.placement_sim import (  # noqa: E402
    PACK,
    RAY_VERSION,
    SPREAD,
    RayNode,
    bundle_order,
    disagreement,
    ray_train_ranks,
    schedule_pg,
)
from tests.integration.conftest import wait_for  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.own_stack]

GPUS = (8, 8, 6, 4)
CPUS = (4, 2, 4, 3)
HEAD_CPUS = 1
DEADLINE_S = 60.0


@dataclass
class FakeCluster:
    ray: Any
    nodes: list[str]  # node ids of the GPU nodes, index k has GPUS[k] GPUs
    head: str

    def view(self) -> dict[str, dict[str, float]]:
        """The GCS's available GPU and CPU per alive node."""
        from ray._private import state

        return {nid: {"GPU": float(res.get("GPU", 0.0)), "CPU": float(res.get("CPU", 0.0))}
                for nid, res in state.available_resources_per_node().items()}

    def expected(self, busy: dict[int, tuple[int, int]]) -> dict[str, dict[str, float]]:
        out = {self.head: {"GPU": 0.0, "CPU": float(HEAD_CPUS)}}
        for k, nid in enumerate(self.nodes):
            g, c = busy.get(k, (0, 0))
            out[nid] = {"GPU": float(GPUS[k] - g), "CPU": float(CPUS[k] - c)}
        return out

    def settle(self, busy: dict[int, tuple[int, int]]) -> dict[str, dict[str, float]]:
        want = self.expected(busy)
        wait_for(lambda: self.view() == want, DEADLINE_S, f"the GCS to see {want}", interval=0.05)
        return want


@pytest.fixture(scope="module")
def cluster() -> Iterator[FakeCluster]:
    import ray
    from ray.cluster_utils import Cluster

    assert ray.__version__ == RAY_VERSION, (
        f"placement_sim follows Ray {RAY_VERSION}'s code; Ray {ray.__version__} is installed: "
        "re-read its scheduling code, update the simulation and RAY_VERSION")
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": HEAD_CPUS, "num_gpus": 0,
                                                      "include_dashboard": False})
    try:
        ids = [c.add_node(num_cpus=CPUS[k], num_gpus=GPUS[k], resources={f"slot{k}": 100}).node_id
               for k in range(len(GPUS))]
        ray.init(address=c.address, log_to_driver=False)
        c.wait_for_nodes()
        fc = FakeCluster(ray, ids, c.head_node.node_id)
        fc.settle({})
        yield fc
    finally:
        ray.shutdown()
        c.shutdown()


@dataclass(frozen=True)
class Case:
    name: str
    strategy: str
    bundles: list[dict[str, float]]
    busy: dict[int, tuple[int, int]]  # node index -> (GPUs, CPUs) held before the group
    by_actors: bool = False  # hold the GPUs with actors instead of placement groups
    pending: bool = False  # Ray cannot place it now


ONE = {"GPU": 1.0}
CASES = [
    Case("pack-empty-4", PACK, [ONE] * 4, {}),
    Case("pack-empty-spills-12", PACK, [ONE] * 12, {}),
    Case("pack-empty-20-permuted", PACK, [ONE] * 20, {}),
    Case("pack-emptiest-first", PACK, [ONE] * 6, {0: (5, 0), 1: (2, 0), 2: (1, 0)}),
    Case("pack-spills-to-next-emptiest", PACK, [ONE] * 10, {0: (5, 0), 1: (2, 0), 2: (1, 0)}),
    Case("pack-24-fills-all", PACK, [ONE] * 24, {0: (1, 0), 3: (1, 0)}),
    Case("pack-mixed-sizes", PACK, [ONE, {"GPU": 2.0}, ONE, {"GPU": 4.0}, {"GPU": 2.0}],
         {0: (3, 0), 1: (1, 0), 3: (1, 0)}),
    Case("pack-gpu-and-cpu", PACK, [{"GPU": 1.0, "CPU": 1.0}] * 5, {0: (4, 3), 1: (4, 0), 2: (2, 1)}),
    Case("pack-actors-hold-gpus", PACK, [ONE] * 7, {0: (2, 0), 1: (1, 0)}, by_actors=True),
    Case("pack-pending", PACK, [ONE] * 20, {0: (4, 0), 1: (4, 0), 2: (2, 0)}, pending=True),
    Case("spread-empty-3", SPREAD, [ONE] * 3, {}),
    Case("spread-empty-12", SPREAD, [ONE] * 12, {}),
    Case("spread-20-permuted", SPREAD, [ONE] * 20, {1: (2, 0)}),
    Case("spread-busy-6", SPREAD, [ONE] * 6, {0: (7, 0), 2: (6, 0)}),
    Case("spread-mixed-sizes", SPREAD, [{"GPU": 2.0}, ONE, {"GPU": 3.0}, ONE, ONE], {1: (3, 0), 3: (2, 0)}),
    Case("spread-gpu-and-cpu", SPREAD, [{"GPU": 1.0, "CPU": 1.0}] * 6, {0: (0, 3), 3: (1, 1)}),
]


def _hold(fc: FakeCluster, case: Case) -> list[Any]:
    """Make the case's nodes busy; returns what to release afterwards."""
    ray = fc.ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    held: list[Any] = []
    for k, (g, c) in case.busy.items():
        if case.by_actors:
            assert c == 0
            @ray.remote(num_gpus=1, num_cpus=0)
            class Holder:  # defined here so that it travels by value, not by module name
                def ready(self) -> bool:
                    return True


            actors = [Holder.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                fc.nodes[k], soft=False)).remote() for _ in range(g)]
            ray.get([a.ready.remote() for a in actors], timeout=DEADLINE_S)
            held += actors
        else:
            bundle = {"GPU": float(g), "CPU": float(c), f"slot{k}": 1.0}
            pg = placement_group([{r: q for r, q in bundle.items() if q}], strategy="STRICT_PACK")
            assert pg.wait(timeout_seconds=DEADLINE_S), f"occupancy on node {k} not placed"
            held.append(pg)
    return held


def _release(fc: FakeCluster, held: list[Any]) -> None:
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    for h in held:
        if isinstance(h, PlacementGroup):
            remove_placement_group(h)
        else:
            fc.ray.kill(h)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_simulation_makes_rays_decision(cluster: FakeCluster, case: Case) -> None:
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    held = _hold(cluster, case)
    pg = None
    try:
        view = cluster.settle(case.busy)
        nodes = [RayNode(nid, free) for nid, free in sorted(view.items())]
        pg = placement_group(case.bundles, strategy=case.strategy)
        if case.pending:
            # Nothing to wait for but time: Ray places a group in milliseconds when it can.
            assert not pg.wait(timeout_seconds=3), "Ray placed a group the case expects it cannot"
            assert placement_group_table(pg)["state"] == "PENDING"
            observed = None
        else:
            assert pg.wait(timeout_seconds=DEADLINE_S), "Ray did not place the group"
            where = placement_group_table(pg)["bundles_to_node_id"]
            observed = [where[b] for b in range(len(case.bundles))]
        why = disagreement(case.strategy, case.bundles, nodes, observed)
        assert why is None, (f"{case.name}: the simulation differs from Ray: {why}\n"
                             f"view {view}\nRay {observed}")
    finally:
        if pg is not None:
            remove_placement_group(pg)
        _release(cluster, held)
        cluster.settle({})


def test_cases_exercise_ties_permutation_and_spills() -> None:
    """The cases above are not all trivial: the claims they back need these shapes."""
    perm = bundle_order([ONE] * 20)
    assert perm != list(range(20)) and sorted(perm) == list(range(20))
    # Ties that Ray breaks by hash order: two empty 8-GPU nodes.
    nodes = [RayNode("a", {"GPU": 8.0}), RayNode("b", {"GPU": 8.0}), RayNode("c", {"GPU": 4.0})]
    assert disagreement(PACK, [ONE] * 4, nodes, ["b"] * 4) is None
    assert disagreement(PACK, [ONE] * 4, nodes, ["a"] * 4) is None
    # ... but not a node that scores lower, nor a split the procedure never makes.
    assert disagreement(PACK, [ONE] * 4, nodes, ["c"] * 4) is not None
    assert disagreement(PACK, [ONE] * 4, nodes, ["a", "a", "b", "b"]) is not None
    assert schedule_pg(PACK, [ONE] * 20, nodes) is not None  # 20 of 20 free: spills onto all three
    assert schedule_pg(PACK, [ONE] * 21, nodes) is None


def test_rank_rule_is_ray_trains() -> None:
    """`ray_train_ranks` orders bundles as Ray Train v2's own sort orders its workers."""
    import random
    from types import SimpleNamespace

    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

    rng = random.Random(7)
    for _ in range(20):
        n = rng.randint(1, 40)
        placed = [rng.choice("abcd") for _ in range(n)]
        next_gpu: dict[str, int] = {}
        workers = []
        for b, node in enumerate(placed):  # lowest free GPU id first, in bundle order
            gpu = next_gpu.get(node, 0)
            next_gpu[node] = gpu + 1
            workers.append(SimpleNamespace(bundle=b, metadata=SimpleNamespace(
                node_id=node, accelerator_ids={"GPU": [str(gpu)]})))
        ordered = WorkerGroup._sort_workers_by_gpu_id_grouped_by_node(workers)
        assert [w.bundle for w in ordered] == ray_train_ranks(placed)


def test_a_nodes_bundles_get_gpu_ids_in_bundle_order(cluster: FakeCluster) -> None:
    """`ray_plan` gives a node's bundles the lowest free GPU ids in BUNDLE order (not
    Ray's sorted order), which is what makes Ray Train's GPU-id sort keep bundle order
    on a node. 20 equal bundles: the first node filled holds bundles 10, 13-19, placed
    in the order 10, 19, 18, ..., 13; one actor per bundle there reports its GPU."""
    ray = cluster.ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_gpus=1, num_cpus=0)
    class Gpu:
        def ids(self) -> list[int]:
            return [int(g) for g in ray.get_gpu_ids()]

    cluster.settle({})
    pg = placement_group([ONE] * 20, strategy=PACK)
    actors: list[Any] = []
    try:
        assert pg.wait(timeout_seconds=DEADLINE_S)
        where = placement_group_table(pg)["bundles_to_node_id"]
        first = where[10]
        mine = sorted(b for b, nid in where.items() if nid == first)
        assert mine == [10, 13, 14, 15, 16, 17, 18, 19]
        actors = [Gpu.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=b)).remote() for b in mine]
        got = ray.get([a.ids.remote() for a in actors], timeout=DEADLINE_S)
        assert got == [[g] for g in range(8)], f"GPU ids of bundles {mine}: {got}"
    finally:
        for a in actors:
            ray.kill(a)
        remove_placement_group(pg)
        cluster.settle({})
