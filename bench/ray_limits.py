"""Ray's own limits under kuangchao: placement groups created and removed per second.

Every job kuangchao starts is one placement group per data-parallel replica
(platform/execution/bundles.py: a bundle per rank, each pinned to its planned
node with `bundle_label_selector`, PACK, named after the job). Ray's GCS creates
and removes placement groups one at a time, so a burst of submissions waits on
it whatever the scheduler decides. This script measures that rate on this
machine, for Ray's own microbenchmark and for the placement groups kuangchao
asks for, and what it means for a burst of 1,000 submissions.

  pg_create_remove_per_s  placement groups created, waited ready and removed per
                          second: batches of 100, as Ray's microbenchmark
                          (ray/_private/ray_perf.py, "placement group
                          create/removal": 100 one-bundle groups of
                          {"custom": 0.001}, created, each waited, all removed)
                          does. Ours: the same batches of kuangchao's one-rank
                          replica group (`replica_pg`: a bundle pinned to a node
                          by label, named). Baseline: Ray's microbenchmark
                          itself, run here. Median over repeats. Higher is
                          better; target ratio >= 0.5 (the label selector and
                          the name may cost at most half the rate). Ray
                          publishes 765/s for its microbenchmark (release
                          perf_metrics, m5.16xlarge); the line carries that
                          figure as `published_per_s`, for reference only.
  pg_burst_1000_s         1,000 submissions at once, each an 8-GPU replica (8
                          bundles): seconds from the first create to every group
                          ready (removal not counted). Ours: kuangchao's groups,
                          spread over the nodes as its placement would (round
                          robin, by label); baseline: the microbenchmark's
                          bundles, 8 a group, placed by Ray (PACK). Informative
                          (no target): what a burst costs in Ray alone, before
                          any rank starts.

The cluster: `--nodes` (4) raylets on this machine (`ray.cluster_utils.Cluster`,
the dashboard off), logical resources only. A rank's GPU is the custom resource
`bench_gpu` here, not `GPU`: Ray accounts GPUs per instance, and a fake node
declaring the thousands of GPUs a burst needs makes every allocation scan them
(8-bundle groups: 84 a second with 1,024 GPUs declared, 22 with 8,192, against
250 for a custom resource), a cost no real 8-GPU node pays. Groups alive on one
raylet cost superlinearly (1,000 8-bundle groups on one node: 47 s; on 4 nodes:
16 s), which is why the burst is spread over several.

Run: .venv/bin/python bench/ray_limits.py [--repeats 3] [--seconds 2] [--burst 1000] [--nodes 4] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` when run as a script

from bench.report import emit, keep_stdout_for_results, log, median, spread_of  # noqa: E402

BENCH = "ray_limits"
BATCH = 100  # groups per batch, as ray_perf.py's NUM_PGS
PUBLISHED_PER_S = 765.0  # Ray's release/perf_metrics "placement group create/removal", for reference
GPU = "bench_gpu"  # a rank's GPU (see the docstring: not `GPU`)
GPUS_PER_NODE = 4096  # logical: a burst's groups fit on one node


def ray_pg(bundles: int) -> Callable[[int], object]:
    """The microbenchmark's group: `bundles` of {"custom": 0.001}, PACK (Ray's default)."""
    from ray.util.placement_group import placement_group

    def make(_i: int) -> object:
        return placement_group([{"custom": 0.001} for _ in range(bundles)])
    return make


def kc_pg(bundles: int, node_ids: list[str]) -> Callable[[int], object]:
    """kuangchao's replica group for `bundles` ranks on one node (round robin over
    `node_ids`), as the controller makes it."""
    from kuangchao.platform.execution.bundles import replica_pg
    from kuangchao.platform.jobs.state import PlacedRank

    def make(i: int) -> object:
        node_id = node_ids[i % len(node_ids)]
        slots = [PlacedRank(rank=r, node="bench", node_id=node_id, leaf="leaf-0", gpus=(r,))
                 for r in range(bundles)]
        return replica_pg(f"bench{i:05d}", slots, [{"CPU": 0.0001, GPU: 1.0}] * bundles)
    return make


def batch_rate(make: Callable[[int], object], seconds: float) -> float:
    """Groups per second over whole batches of BATCH: create all, wait each, remove all."""
    from ray.util.placement_group import remove_placement_group

    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pgs = [make(done + i) for i in range(BATCH)]
        for pg in pgs:
            if not pg.wait(timeout_seconds=60):
                raise RuntimeError("a placement group was not ready within 60 s")
        for pg in pgs:
            remove_placement_group(pg)
        done += BATCH
    return done / (time.perf_counter() - t0)


def burst_s(make: Callable[[int], object], n: int) -> float:
    """Seconds from the first create of `n` groups to all of them ready; then removed."""
    from ray.util.placement_group import remove_placement_group

    t0 = time.perf_counter()
    pgs = [make(i) for i in range(n)]
    for pg in pgs:
        if not pg.wait(timeout_seconds=300):
            raise RuntimeError(f"a placement group of the burst of {n} was not ready within 300 s")
    took = time.perf_counter() - t0
    for pg in pgs:
        remove_placement_group(pg)
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0, help="timed seconds per rate run")
    ap.add_argument("--burst", type=int, default=1000, help="submissions in the burst")
    ap.add_argument("--nodes", type=int, default=4, help="raylets on this machine")
    ap.add_argument("--quick", action="store_true", help="1 repeat of 0.5 s, a burst of 100, 2 nodes")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.seconds, args.burst, args.nodes = 1, 0.5, 100, 2
    if args.repeats < 1 or args.seconds <= 0 or args.burst < 1 or args.nodes < 1:
        ap.error("--repeats, --burst and --nodes must be at least 1 and --seconds above 0")
    keep_stdout_for_results()

    import ray
    from ray.cluster_utils import Cluster

    per_node = {"num_cpus": 1, "resources": {"custom": 1000, GPU: GPUS_PER_NODE}}
    cluster = Cluster(initialize_head=True, head_node_args={**per_node, "include_dashboard": False})
    try:
        for _ in range(args.nodes - 1):
            cluster.add_node(**per_node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        measure(args)
    finally:
        ray.shutdown()
        cluster.shutdown()


def measure(args: argparse.Namespace) -> None:
    import ray

    node_ids = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    log(f"Ray {ray.__version__}, {len(node_ids)} raylets; baseline: ray_perf.py's 'placement group "
        f"create/removal' (batches of {BATCH} one-bundle groups of {{'custom': 0.001}}); ours: "
        "replica_pg (PACK, bundle_label_selector ray.io/node-id, named)")
    ours = kc_pg(1, node_ids)
    theirs = ray_pg(1)
    batch_rate(ours, 0.2), batch_rate(theirs, 0.2)  # warm-up: the GCS's first groups
    ours_r, theirs_r = [], []
    for _ in range(args.repeats):  # interleaved, so drift hits both alike
        ours_r.append(batch_rate(ours, args.seconds))
        theirs_r.append(batch_rate(theirs, args.seconds))
    log(f"create+wait+remove per s: ours {spread_of(ours_r)}, Ray's microbenchmark "
        f"{spread_of(theirs_r)} (published: {PUBLISHED_PER_S:.0f}/s)")
    emit(BENCH, "pg_create_remove_per_s", "groups/s", median(ours_r), median(theirs_r), 0.5,
         better="higher", target_on="ratio", spread={"ours": ours_r, "baseline": theirs_r},
         published_per_s=PUBLISHED_PER_S,
         notes="published_per_s: Ray's release figure on an m5.16xlarge, not this machine")

    ours_b = burst_s(kc_pg(8, node_ids), args.burst)
    theirs_b = burst_s(ray_pg(8), args.burst)
    per_s = args.burst / ours_b
    log(f"burst of {args.burst} 8-GPU replicas: ours {ours_b:.2f} s ({per_s:.0f} groups/s), "
        f"microbenchmark bundles {theirs_b:.2f} s")
    emit(BENCH, "pg_burst_1000_s", "s", ours_b, theirs_b, None, better="lower",
         target_on="ours", burst=args.burst, nodes=len(node_ids), groups_per_s=round(per_s, 1))


if __name__ == "__main__":
    main()
