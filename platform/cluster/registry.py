"""The node registry: what nodes the cluster has and how they are wired.

`nodes_from_ray` turns `ray.nodes()` output into `NodeInfo` values using the
`kc.io/*` labels (see topology.py); it is pure so tests feed it plain dicts.
The `Registry` class is what the Ray actor hosts: it refreshes from Ray and
publishes the node list to Redis for the API.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from kuangchao.platform.cluster.drain import mark_draining, notices_from
from kuangchao.platform.cluster.hardware import gpu_type_from_ray
from kuangchao.platform.cluster.overrides import OVERRIDES_INFO, apply_overrides
from kuangchao.platform.cluster.probe import apply_probe
from kuangchao.platform.cluster.topology import LABEL_ROLE, NodeInfo, gpu_resource, node_from_labels

ACCELERATOR_PREFIX = "accelerator_type:"

log = logging.getLogger(__name__)


def nodes_from_ray(ray_nodes: list[dict[str, Any]]) -> tuple[NodeInfo, ...]:
    """Convert Ray's node table into `NodeInfo`s, sorted by name.

    Nodes labelled `kc.io/role=head` host the control plane and are left out
    of the GPU pool even if they have GPUs.
    """
    out = []
    for n in ray_nodes:
        labels = n.get("Labels") or {}
        if labels.get(LABEL_ROLE) == "head":
            continue
        res = n.get("Resources") or {}
        gpus = int(res.get("GPU", 0))
        # Ray adds `accelerator_type:H100` (say) where it detected real GPUs; an
        # operator may add a more exact one by hand (`A100-80G` beside `A100`),
        # which is the one that tells the catalogue type.
        kinds = sorted((k.partition(":")[2] for k in res if k.startswith(ACCELERATOR_PREFIX)),
                       key=lambda kind: (gpu_type_from_ray(kind) is None, kind))
        out.append(node_from_labels(
            node_id=n["NodeID"], labels=labels, gpus=gpus,
            cpus=float(res.get("CPU", 0)), alive=bool(n.get("Alive", False)),
            pinned_gpus=gpus > 0 and all(gpu_resource(g) in res for g in range(gpus)),
            accelerator=kinds[0] if gpus > 0 and kinds else None))
    # A name may repeat when a node died and rejoined; keep the live entry.
    by_name: dict[str, NodeInfo] = {}
    for node in sorted(out, key=lambda x: (x.name, x.alive)):
        by_name[node.name] = node
    return tuple(sorted(by_name.values(), key=lambda x: x.name))


def node_ips(ray_nodes: list[dict[str, Any]]) -> dict[str, str]:
    """Ray node id -> the node's IP, for the nodes alive. The control plane checks
    a rank's metrics address against it (platform/observability/scrape_targets.py)."""
    return {n["NodeID"]: str(n["NodeManagerAddress"]) for n in ray_nodes
            if n.get("Alive") and n.get("NodeID") and n.get("NodeManagerAddress")}


def head_node_id(ray_nodes: list[dict[str, Any]]) -> str | None:
    for n in ray_nodes:
        if n.get("Alive") and (n.get("Labels") or {}).get(LABEL_ROLE) == "head":
            return n["NodeID"]
    return None


def draining_nodes() -> dict[str, Any]:
    """Ray's GCS table of the nodes being drained, `{node_id_hex: deadline_ms}` (drain.py).

    Read from the GCS, the only writer of drains, on every call (Ray Train polls the
    same table). A process not connected to Ray (a unit test, a tool) knows no drain,
    and Ray is not loaded for it. A GCS that cannot answer means no drain is known: the
    node view must not fail over it, and a node about to go is then caught as lost.
    """
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return {}
    try:
        return ray._private.state.state.get_draining_nodes() or {}
    except Exception as exc:  # noqa: BLE001 -- a private API, which must not stop scheduling
        log.warning("could not read Ray's draining nodes: %s", exc)
        return {}


def current_nodes(store=None, raw: list[dict[str, Any]] | None = None) -> tuple[NodeInfo, ...]:
    """The node view as the scheduler sees it (Ray's nodes, the probe's spines,
    the operator's overrides of GPU type and emulated speed), without publishing
    it: the job controller reads each rank's GPU type and emulated speed from it."""
    if raw is None:
        import ray

        raw = ray.nodes()
    nodes = nodes_from_ray(raw)
    if store is not None:
        nodes = apply_probe(nodes, store.info("probe"))
        nodes = apply_overrides(nodes, store.info(OVERRIDES_INFO))
    return nodes


class Registry:
    """Keeps the node view current. Hosted by a Ray actor; reads `ray.nodes()`."""

    def __init__(self, store=None) -> None:
        self.store = store

    def snapshot(self) -> tuple[NodeInfo, ...]:
        import ray

        raw = ray.nodes()
        # A draining node shows as such in `kc nodes`; the scheduler places nothing there.
        nodes = mark_draining(current_nodes(self.store, raw), notices_from(draining_nodes()))
        if self.store is not None:
            # `ips` beside the node list: the API's node route shows `nodes` only.
            self.store.set_info("nodes", {"nodes": [n.to_json() for n in nodes],
                                          "ips": node_ips(raw), "updated_at": time.time()})
        return nodes
