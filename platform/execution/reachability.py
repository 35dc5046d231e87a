"""Why a node's ranks stopped heartbeating, asked of the node itself through Ray.

A rank whose heartbeats stop has died, hung, or lost its network. Ray marks a
node dead only after its health checks fail for tens of seconds, and a node
cut from Redis alone stays alive in Ray for good. So when heartbeats expire,
the controller runs one tiny task pinned to the node (no CPU asked) that
opens a TCP connection to Redis from there:

- the task does not come back within `NODE_PROBE_TIMEOUT_S`: the node is cut
  off from the controller's side of the network (or its raylet is gone);
- it comes back unable to connect: the node is up but cannot reach Redis;
- it connects: the node's network is fine, and the rank itself is the fault.

A task needs a worker process, and Ray starts one for it: about 2 s on a busy
node, spent while the job waits. So where the job keeps a warm spare on that
node (`spare_workers`, spares.py), the spare runs the same connection instead:
an actor already up answers in milliseconds, and a node cut from the network
leaves it as silent as it leaves a task. Should the spare itself be gone (its
process died, not its node), the task runs after all.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any

from kuangchao.workers.runtime.reach import connect_error

NODE_PROBE_TIMEOUT_S = 8.0
CONNECT_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class NodeReach:
    """What the probe found: `answered` (the node ran the task) and, if so, the
    error connecting to Redis from there (empty when it connected)."""

    answered: bool
    redis_error: str = ""

    @property
    def network_fault(self) -> bool:
        return not self.answered or bool(self.redis_error)

    def describe(self, node: str, redis: tuple[str, int]) -> str:
        if not self.answered:
            return (f"node {node} answers neither heartbeats nor Ray within "
                    f"{NODE_PROBE_TIMEOUT_S:.0f}s: it is cut off from the network")
        if self.redis_error:
            return (f"node {node} answers Ray but cannot reach Redis at {redis[0]}:{redis[1]} "
                    f"({self.redis_error}): it is cut off from Redis")
        return f"node {node} reaches Redis"


def probe(node_id: str, redis: tuple[str, int], via: Any = None) -> NodeReach:
    """Ask node `node_id` whether it can reach Redis (see the module's docstring).

    `via`: a warm spare's actor on that node, asked first (`SpareActor.reaches`)."""
    import ray

    deadline = time.monotonic() + NODE_PROBE_TIMEOUT_S
    if via is not None:
        ref = via.reaches.remote(*redis, CONNECT_TIMEOUT_S)
        ready, _ = ray.wait([ref], timeout=NODE_PROBE_TIMEOUT_S)
        if not ready:
            return NodeReach(False)
        try:
            return NodeReach(True, ray.get(ref))
        except ray.exceptions.RayActorError:  # the spare died, not necessarily its node
            pass
        except Exception:  # noqa: BLE001 -- it could not run there: as unanswered
            return NodeReach(False)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(connect_error).options(
        num_cpus=0, max_retries=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
    ref = task.remote(*redis, CONNECT_TIMEOUT_S)
    ready, _ = ray.wait([ref], timeout=max(0.0, deadline - time.monotonic()))
    if not ready:
        ray.cancel(ref, force=True)
        return NodeReach(False)
    try:
        return NodeReach(True, ray.get(ref))
    except Exception:  # noqa: BLE001 -- the task could not run there: as unanswered
        return NodeReach(False)


def redis_address(url: str | None) -> tuple[str, int] | None:
    """Host and port of a Redis URL (None without one)."""
    if not url:
        return None
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 6379


def alive_nodes() -> set[str]:
    """The ids of the nodes Ray counts alive (one call to the GCS)."""
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def node_lost(node_id: str | None) -> bool:
    """Whether a node is gone: Ray says so, or its raylet no longer takes connections.

    Ray marks a node dead only after its health checks fail for a while
    (tens of seconds); a refused connection to the raylet says it at once.
    """
    return bool(node_id) and node_id in lost_among({node_id})


def lost_among(node_ids: set[str] | frozenset[str]) -> frozenset[str]:
    """Which of `node_ids` are gone, as `node_lost` judges each, from one read of
    Ray's node table and the raylet connects made side by side (a judgement of
    a job on many nodes must not cost a GCS read and a connect timeout per node)."""
    wanted = {n for n in node_ids if n}
    if not wanted:
        return frozenset()
    import ray

    entries = {n["NodeID"]: n for n in ray.nodes() if n["NodeID"] in wanted}
    gone = {n for n in wanted if not entries.get(n, {}).get("Alive")}
    up = [entries[n] for n in wanted - gone]
    if up:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(16, len(up))) as pool:
            refused = list(pool.map(_raylet_refuses, up))
        gone |= {e["NodeID"] for e, r in zip(up, refused, strict=True) if r}
    return frozenset(gone)


def _raylet_refuses(entry: dict) -> bool:
    try:
        with socket.create_connection((entry["NodeManagerAddress"],
                                       entry["NodeManagerPort"]), timeout=2):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False  # slow or filtered is not proof of death; heartbeats decide
