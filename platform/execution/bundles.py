"""What a job asks Ray for: one bundle per rank, one placement group per replica.

A bundle holds the rank's CPUs and GPUs and, on nodes whose GPUs carry one
`kc_gpu_N` resource each, exactly the GPU ids the plan chose. A placement
group holds one data-parallel replica, its bundles pinned to the planned
nodes with `bundle_label_selector`, so that a resize adds or frees whole
replicas without touching the others.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import placement_group

from kuangchao.platform.cluster.registry import nodes_from_ray
from kuangchao.platform.cluster.topology import gpu_resource
from kuangchao.platform.jobs.state import PlacedRank
from kuangchao.platform.spec.jobspec import JobSpec


def pinned_nodes() -> set[str]:
    """Ray node ids whose GPUs carry one `kc_gpu_N` resource each."""
    return {n.node_id for n in nodes_from_ray(ray.nodes()) if n.pinned_gpus}


def rank_resources(spec: JobSpec, slot: PlacedRank, pinned: set[str]) -> dict[str, float]:
    """The bundle of one rank: CPUs, GPUs and, on pinned nodes, the exact GPU ids."""
    par = spec.parallel
    bundle: dict[str, float] = {"CPU": par.cpus_per_rank}
    if par.gpus_per_rank:
        bundle["GPU"] = par.gpus_per_rank
        if slot.node_id in pinned:
            bundle.update({gpu_resource(g): 1 for g in slot.gpus})
    return bundle


def replica_pg(job_id: str, slots: list[PlacedRank], bundles: list[dict[str, float]]) -> Any:
    """The placement group of one replica, named after its first rank."""
    selectors = [{"ray.io/node-id": p.node_id} for p in slots]
    return placement_group(bundles, strategy="PACK", name=f"kc-{job_id}-r{slots[0].rank}",
                           bundle_label_selector=selectors)
