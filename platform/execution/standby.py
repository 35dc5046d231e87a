"""Where a job keeps its standby spares: warm processes on nodes it does not use.

A job whose survivors keep their work relocates a replica whose node is lost or
draining (relocation.py). The new rank there is a fresh process, and importing
torch and the trainer is most of what that move costs (6 to 9 s on a busy
2-core node). With `fault_tolerance.standby_spares: N`, the job keeps a warm
spare (spares.py) on N nodes it does not use; its relocation asks the scheduler
to place there first, and the spare adopts the new rank.

A standby node must be able to take a replica as the scheduler would place it:
alive, neither draining nor quarantined, of the job's GPU type, with as many
GPUs as one replica needs on one node, and its GPUs pinned (`kc_gpu_N`, as `kc node join`
starts nodes), so that the spare knows which GPUs the placement group reserved
for it without a process of its own in the group. Among those, nodes under the
job's own leaf switches come first (the placement solver's preference too),
then by name. A node that stays eligible keeps its spare: choosing again must
not restart a warm process for nothing.

`spare_entries` is what the job JSON's `spares` shows of every spare, own or standby.

Pure logic: no Ray, Redis or torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kuangchao.platform.cluster.topology import NodeInfo


def standby_nodes(nodes: Iterable[NodeInfo], used: set[str], held: set[str], count: int,
                  gpus: int, gpu_type: str | None, blocked: set[str] = frozenset()) -> set[str]:
    """The Ray node ids of at most `count` nodes to keep a standby spare on.

    Args:
        nodes: The node view (with `draining` marked).
        used: Ray node ids of the nodes the job runs on (their spares are the job's own).
        held: Ray node ids of the nodes that hold a spare now (kept if eligible: a spare
            of a node the job left becomes a standby without a restart).
        count: How many standby nodes the job asks for.
        gpus: GPUs one replica needs on one node.
        gpu_type: The GPU type of the job's nodes (None: any).
        blocked: Names of nodes the job may not use (quarantined).
    """
    if count <= 0:
        return set()
    nodes = list(nodes)
    leaves = {n.leaf for n in nodes if n.node_id in used}
    eligible = [n for n in nodes
                if n.alive and n.node_id and n.node_id not in used and not n.draining
                and n.name not in blocked and (gpus == 0 or (n.pinned_gpus and n.gpus >= gpus))
                and (gpu_type is None or n.gpu_type == gpu_type)]
    eligible.sort(key=lambda n: (n.node_id not in held, n.leaf not in leaves, n.name))
    return {n.node_id for n in eligible[:count]}


def names_of(nodes: Iterable[NodeInfo], node_ids: set[str]) -> list[str]:
    """The names of the nodes with these Ray node ids, sorted (what a relocation prefers)."""
    return sorted(n.name for n in nodes if n.node_id in node_ids)


def spare_entries(states: dict[str, str], standby: set[str],
                  names: dict[str, str]) -> tuple[dict[str, Any], ...]:
    """The job JSON's `spares`: one `{node, state, standby}` per spare, the job's own
    nodes first, then by name.

    Args:
        states: Ray node id -> `warm`, `warming` or `failed` (SparePool.states).
        standby: Ray node ids of the standby spares.
        names: Ray node id -> node name (a node missing: the id's first 12 characters).
    """
    entries = [{"node": names.get(node_id) or node_id[:12], "state": state,
                "standby": node_id in standby} for node_id, state in states.items()]
    return tuple(sorted(entries, key=lambda e: (e["standby"], e["node"])))
