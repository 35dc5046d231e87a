"""Node churn on a running `BenchCluster`, for both halves of bench/resize.py.

* `add_node()`: one more raylet joining the fake cluster, labelled and sized
  like the nodes `kc up` started (`kc.io/leaf`, `kc.io/node`, `kc.io/nvlink`,
  logical GPUs plus one `kc_gpu_<i>` resource per GPU), so that kuangchao's
  placement and Ray Train's label selector treat it as just another node;
* `kill_node()`: SIGKILL of a node's raylet, what
  `ray.cluster_utils.Cluster.remove_node` does to simulate a lost machine
  (the node's worker processes notice their raylet is gone and exit);
* `retire_node()`: an orderly stop of a raylet (SIGTERM), dead at once;
* `leaf_nodes()`, `node_named()`, `node_of_pid()`: which Ray nodes exist and
  host what, from `ray.nodes()` and the process table.

An added raylet lives in the head's temp dir (a joining raylet takes its
session directory from the GCS), so `localcluster.down()`, which stops every
process whose command line names that dir, stops it too; `add_node` checks
this and the bench's teardown needs nothing extra.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from bench.harness import BenchCluster, log
from kuangchao.platform.cluster.topology import LABEL_LEAF, LABEL_NODE, NodeInfo, gpu_resource
from kuangchao.platform.runtime import procs, ray_nodes

LEAF = "leaf-0"  # the leaf of every node `local_cluster` starts


def leaf_nodes(alive: bool = True) -> list[dict[str, Any]]:
    """The Ray nodes that can host training (they carry a `kc.io/leaf` label), sorted by name."""
    import ray

    nodes = [n for n in ray.nodes()
             if LABEL_LEAF in (n.get("Labels") or {}) and (n["Alive"] or not alive)]
    return sorted(nodes, key=lambda n: n["Labels"].get(LABEL_NODE, ""))


def node_named(name: str) -> dict[str, Any] | None:
    """The live Ray node labelled `kc.io/node=name`, if any."""
    return next((n for n in leaf_nodes() if n["Labels"].get(LABEL_NODE) == name), None)


def raylet_pid(node_id: str) -> int | None:
    """The pid of the raylet Ray started for a node (its command line names the node id)."""
    needle = f"--node_id={node_id}"
    for _ in range(50):
        pids = [p for p in procs._all_pids()
                if "/raylet/raylet " in procs._cmdline(p) and needle in procs._cmdline(p)]
        # A process the raylet has just forked to start a worker carries the raylet's
        # command line until it execs: keep the one whose parent is not a match.
        pids = [p for p in pids if procs._ppid(p) not in pids]
        if len(pids) <= 1:
            return pids[0] if pids else None
        time.sleep(0.02)
    raise RuntimeError(f"expected one raylet with {needle}, found {pids}")


def node_of_pid(pid: int) -> str | None:
    """The Ray node id a worker process belongs to: the raylet among its ancestors.

    Ray's worker processes are children of their node's raylet, so walking up
    the process tree is exact even though all "nodes" share one machine.
    """
    p = pid
    for _ in range(16):
        cmd = procs._cmdline(p)
        if "/raylet/raylet " in cmd:
            for arg in cmd.split():
                if arg.startswith("--node_id="):
                    return arg.split("=", 1)[1]
        p = procs._ppid(p)
        if p <= 1:
            return None
    return None


def _descendants(pid: int) -> list[int]:
    """All processes below `pid` in the process tree (a raylet's workers and agents)."""
    children: dict[int, list[int]] = {}
    for p in procs._all_pids():
        children.setdefault(procs._ppid(p), []).append(p)
    out, stack = [], list(children.get(pid, []))
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(children.get(p, []))
    return out


def kill_node(node_id: str, with_workers: bool = False) -> float:
    """SIGKILL the node's raylet; returns `time.time()` just before the signal.

    With only the raylet killed (`Cluster.remove_node`'s way), the node's
    worker processes live on until they notice their raylet is gone: about
    1-2 s here, during which a DDP job keeps stepping (and may even checkpoint).
    `with_workers=True` SIGKILLs the raylet's whole process tree at once, like
    a machine that loses power.
    """
    pid = raylet_pid(node_id)
    if pid is None:
        raise RuntimeError(f"no raylet process for node {node_id}")
    tree = _descendants(pid) if with_workers else []
    t = time.time()
    for p in [pid, *tree]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return t


def retire_node(node_id: str, timeout_s: float = 60.0) -> float:
    """Stop a node's raylet the orderly way (SIGTERM, as `ray stop` does): it tells
    the GCS it is leaving, so the node is dead in `ray.nodes()` at once instead of
    after the GCS's failed health checks. Returns how long that took."""
    pid = raylet_pid(node_id)
    if pid is None:
        raise RuntimeError(f"no raylet process for node {node_id}")
    t0 = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    while any(n["NodeID"] == node_id for n in leaf_nodes()):
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"node {node_id} still alive {timeout_s:.0f}s after SIGTERM")
        time.sleep(0.05)
    return time.monotonic() - t0


def add_node(cluster: BenchCluster, name: str, cpus: int, gpus: int, leaf: str = LEAF,
             timeout_s: float = 120.0, prefix: tuple[str, ...] = ()) -> tuple[str, float]:
    """Start one more raylet like `ray_nodes.start_ray` starts each node.

    Uses `ray_nodes.ray_start` itself, so the new raylet gets the same
    environment (Redis settings for kuangchao's actors), its own dashboard-agent
    port and the same object-store size. The node counts as joined when
    `ray.nodes()` first reports it alive (polled every 20 ms while `ray start`
    runs, which exits a second or so after the raylet has registered).

    Call it from the process that runs `local_cluster` (it reads KC_HOME) and
    never concurrently with another raylet start (they race for local ports).
    `prefix` runs `ray start` under a command (bench/node_start.py's, which joins a CPU group).

    Returns:
        (node id, `time.time()` when `ray.nodes()` first showed it alive).
    """
    if node_named(name) is not None:
        raise ValueError(f"a live node named {name} exists already")
    info = NodeInfo(name=name, gpus=gpus, islands=(tuple(range(gpus)),) if gpus else (),
                    leaf=leaf, cpus=float(cpus))
    labels = ",".join(f"{k}={v}" for k, v in info.labels().items())
    pinned = json.dumps({gpu_resource(g): 1 for g in range(gpus)})
    state = cluster.state
    proc = ray_nodes.ray_start([f"--address={state['ray_address']}", f"--num-cpus={cpus}",
                                f"--num-gpus={gpus}", f"--labels={labels}",
                                f"--resources={pinned}"],
                               ray_nodes.ray_env(state), f"ray-{name}.log", prefix=prefix)
    # Poll while `ray start` runs: the raylet registers (and schedulers may see
    # it) about a second before the `ray start` process gets round to exiting.
    deadline = time.monotonic() + timeout_s
    while (node := node_named(name)) is None:
        if proc.poll() not in (None, 0):
            raise RuntimeError(f"`ray start` for {name} failed; see {cluster.tmp}/home/logs/ray-{name}.log")
        if time.monotonic() > deadline:
            raise TimeoutError(f"node {name} not alive in ray.nodes() within {timeout_s:.0f}s")
        time.sleep(0.02)
    joined = time.time()
    if proc.wait(timeout=timeout_s) != 0:
        raise RuntimeError(f"`ray start` for {name} failed; see {cluster.tmp}/home/logs/ray-{name}.log")
    _check_covered_by_down(state, node["NodeID"])
    return node["NodeID"], joined


def _check_covered_by_down(state: dict[str, Any], node_id: str) -> None:
    """Warn if `localcluster.down()` would miss the added raylet (it matches the temp dir)."""
    pid = raylet_pid(node_id)
    if pid is not None and state["temp_dir"] not in procs._cmdline(pid):
        log(f"raylet {pid} of the added node is outside {state['temp_dir']}: "
            "`kc down` will not stop it")


def session_dir(cluster: BenchCluster) -> Path | None:
    """The Ray session folder of the cluster (logs of every node live under it)."""
    latest = Path(cluster.state["temp_dir"]) / "session_latest"
    return latest.resolve() if latest.exists() else None
