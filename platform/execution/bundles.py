"""What a job asks Ray for: one bundle per rank, one placement group per replica.

A bundle holds the rank's CPUs and GPUs and, on nodes whose GPUs carry one
`kc_gpu_N` resource each, exactly the GPU ids the plan chose. A placement
group holds one data-parallel replica, its bundles pinned to the planned
nodes with `bundle_label_selector`, so that a resize adds or frees whole
replicas without touching the others.
"""

from __future__ import annotations

import secrets
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from kuangchao.platform.cluster.registry import nodes_from_ray
from kuangchao.platform.cluster.topology import gpu_resource
from kuangchao.platform.errors import RankFailed
from kuangchao.platform.jobs.state import PlacedRank
from kuangchao.platform.spec.jobspec import JobSpec


def first_line(exc: BaseException) -> str:
    """An error's first line, for a message (its type's name when it has no text)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


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
    """The placement group of one replica, named after its job and first rank.

    Ray refuses a second group of a name that is still alive, and a rank's number is
    not the group's for life: a replica moved off a drained node joins as rank
    `world` (and is renumbered), and the next relocation asks for rank `world` again
    while the first group still lives. A random tail keeps each name unique."""
    selectors = [{"ray.io/node-id": p.node_id} for p in slots]
    name = f"kc-{job_id}-r{slots[0].rank}-{secrets.token_hex(3)}"
    return placement_group(bundles, strategy="PACK", name=name, bundle_label_selector=selectors)


def joiner_pgs(job_id: str, spec: JobSpec, joiners: list[tuple[list[PlacedRank], Any]],
               pinned: set[str]) -> list[Any]:
    """A placement group for each joiner that has none (set in `joiners`); returns the
    new ones.

    Raises:
        RankFailed: Ray refused one (those made here are removed first): a planned
            resize is then called off and a loss requeues the job, where an error
            of Ray's own kind would have failed it.
    """
    fresh: list[Any] = []
    try:
        for i, (slots, pg) in enumerate(joiners):
            if pg is None:
                pg = replica_pg(job_id, slots, [rank_resources(spec, p, pinned) for p in slots])
                joiners[i] = (slots, pg)
                fresh.append(pg)
    except (ray.exceptions.RayError, ValueError) as exc:
        for pg in fresh:
            remove_placement_group(pg)
        raise RankFailed(f"a new replica's placement group could not be made: "
                         f"{first_line(exc)}") from None
    return fresh
