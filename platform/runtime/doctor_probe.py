"""The facts `kc doctor` judges: this machine, Redis, Ray and every node of it,
checkpoint storage, and the ports of the local stack. Every probe has a short
deadline and reports a failure as a fact, never as an exception."""

from __future__ import annotations

import os
import platform as _platform
import shutil
import socket
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kuangchao.platform.cluster.topology import LABEL_NODE, LABEL_ROLE
from kuangchao.platform.jobs.redis_client import redact
from kuangchao.platform.jobs.redis_sizing import ClusterSize, node_slots
from kuangchao.platform.runtime import procs
from kuangchao.platform.runtime.doctor import (
    Finding,
    clock_skew,
    local_versions,
    port_findings,
    ray_findings,
    redis_findings,
    storage_findings,
    versions_across_nodes,
)
from kuangchao.platform.runtime.doctor_capacity import capacity_findings
from kuangchao.platform.settings import (
    DEFAULT_API_PORT,
    DEFAULT_DASHBOARD_PORT,
    Settings,
    kc_home,
    read_cluster_state,
)
from kuangchao.platform.storage.urls import ObjectUrl

# The device files a GPU runtime opens (NVIDIA, ROCm, WSL). With none of them CUDA
# cannot be available, so the probe reads torch's version from its package metadata
# instead of importing torch: seconds of CPU on every node for each `kc doctor`.
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def node_facts() -> dict[str, Any]:
    """Versions and the clock of the machine this runs on (also run on every node)."""
    import importlib.metadata

    import ray

    try:
        version: str | None = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        version = None
    cuda = nccl = None
    gpus = 0
    if version and any(os.path.exists(f) for f in GPU_DEVICE_FILES):
        import torch

        cuda = torch.version.cuda if torch.cuda.is_available() else None
        if cuda:
            gpus = torch.cuda.device_count()
            try:
                nccl = ".".join(map(str, torch.cuda.nccl.version()))
            except Exception:  # a build without NCCL
                nccl = None
    return {"node": socket.gethostname(), "python": _platform.python_version(),
            "torch": version, "ray": ray.__version__, "cuda": cuda, "nccl": nccl,
            "gpus": gpus, "time": time.time()}


def redis_facts(url: str | None) -> dict[str, Any]:
    import redis

    if not url:
        return {"url": None, "error": "no Redis configured (KC_REDIS_URL, or `kc up`)"}
    out: dict[str, Any] = {"url": redact(url)}
    try:  # a raw client, not the store: `kc doctor` probes a URL, with short timeouts, to say what it finds
        client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=5,
                                      decode_responses=True)
        client.ping()
        info = client.info("server")
        out["version"] = info.get("valkey_version") or info.get("redis_version")
        out["user"] = client.execute_command("ACL", "WHOAMI")
    except redis.RedisError as exc:
        return {**out, "error": str(exc) or type(exc).__name__}
    try:
        client.execute_command("ACL", "LIST")  # what creating job users needs
        out["acl"] = True
    except redis.RedisError as exc:
        out.update(acl=False, acl_error=str(exc))
    out.update(_capacity_facts(client))
    return out


def _capacity_facts(client: Any) -> dict[str, Any]:
    """Redis's limits (CONFIG GET, which a managed Redis may refuse) and their use (INFO)."""
    import redis

    out: dict[str, Any] = {}
    try:
        info = {**client.info("clients"), **client.info("memory"), **client.info("stats")}
        out.update({k: info.get(k) for k in ("connected_clients", "used_memory",
                                             "rejected_connections")})
    except redis.RedisError as exc:
        return {"config_error": f"INFO: {exc}"}
    try:
        for name in ("maxclients", "maxmemory", "maxmemory-policy"):
            out[name.replace("-", "_")] = client.config_get(name).get(name)
    except redis.RedisError as exc:
        out["config_error"] = f"CONFIG GET: {exc or type(exc).__name__}"
    return out


def storage_facts(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"path": str(path)}
    # A folder not made yet is judged by the nearest one that exists: a check
    # creates nothing.
    where = path
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        with tempfile.NamedTemporaryFile(dir=where, prefix=".kc-doctor-") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        out["free_gb"] = shutil.disk_usage(where).free / 1e9
    except OSError as exc:
        out["error"] = exc.strerror or str(exc)
    return out


def ray_facts(address: str | None, timeout_s: float = 60.0) -> tuple[dict[str, Any], list[dict]]:
    """The cluster, and `node_facts` from every live node (with its clock skew)."""
    import ray

    from kuangchao.platform.runtime.ray_connect import connect

    address = address or "auto"
    host, _, port = address.rpartition(":")
    if port.isdigit() and not procs.port_open(int(port), host or "127.0.0.1"):
        return {"address": address, "error": f"nothing listens on {address}"}, []
    try:
        if not ray.is_initialized():
            connect(address)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        return {"address": address, "error": str(exc).splitlines()[0]}, []
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = [n for n in ray.nodes() if n.get("Alive")]
    probe, clock = ray.remote(num_cpus=0)(node_facts), ray.remote(num_cpus=0)(_now)

    def on(node: dict[str, Any], fn: Any) -> Any:
        return fn.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            node["NodeID"], soft=False)).remote()

    refs = {n["NodeID"]: on(n, probe) for n in alive}  # in parallel: a GPU node imports torch
    reports = []
    for node in alive:
        try:
            rep = ray.get(refs[node["NodeID"]], timeout=timeout_s)
            rep["skew_s"] = _skew(lambda n=node: ray.get(on(n, clock), timeout=timeout_s))
        except Exception as exc:
            reports.append({"node": node.get("NodeManagerAddress"), "error": str(exc)[:200]})
            continue
        labels = node.get("Labels") or {}
        rep["node"] = labels.get(LABEL_NODE) or labels.get(LABEL_ROLE) or rep["node"]
        reports.append(rep)
    gpus = sum(n.get("Resources", {}).get("GPU", 0) for n in alive)
    # Rank slots as redis_sizing counts them; the head offers no CPUs or GPUs, so none.
    slots = [node_slots(n.get("Resources", {}).get("GPU", 0), n.get("Resources", {}).get("CPU", 0))
             for n in alive]
    return {"address": address, "nodes": len(alive), "gpus": gpus,
            "slot_nodes": sum(1 for s in slots if s), "slots": sum(slots)}, reports


def _now() -> float:
    return time.time()


def _skew(read_clock: Any, samples: int = 5) -> float:
    """A node's clock against ours: its reading against the midpoint of the round
    trip, from the sample with the shortest round trip (the least uncertain)."""
    best: tuple[float, float] | None = None
    for _ in range(samples):
        t0 = time.time()
        theirs = read_clock()
        t1 = time.time()
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, theirs - (t0 + t1) / 2)
    assert best is not None
    return best[1]


def port_facts(state: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The running stack's API and dashboard answer; with none, the default ports are free."""
    if state:
        api = state.get("api_port")
        out = []
        if api:
            out.append({"what": "API", "port": api, "flag": "--api-port",
                        "ours": _answers(f"http://127.0.0.1:{api}/healthz")})
        dash = (state.get("dashboard_url") or "").rsplit(":", 1)[-1]
        if dash.isdigit():
            out.append({"what": "Ray dashboard", "port": int(dash), "flag": "--dashboard-port",
                        "ours": _answers(f"http://127.0.0.1:{dash}/api/gcs_healthz")})
        return out
    return [{"what": what, "port": port, "flag": flag, "open": procs.port_open(port)}
            for what, port, flag in (("API", DEFAULT_API_PORT, "--api-port"),
                                     ("Ray dashboard", DEFAULT_DASHBOARD_PORT, "--dashboard-port"))]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status == 200
    except OSError:
        return False


def examine(settings: Settings, checkpoint_path: Path | ObjectUrl | None = None) -> list[Finding]:
    """Every finding, in the order `kc doctor` prints them. An object-store
    `checkpoint_path` (`doctor_store.checkpoint_target`) is checked from here and
    from every node of the cluster (doctor_store.py)."""
    mine = node_facts()
    findings = local_versions(mine)
    store = redis_facts(settings.redis_url)
    findings += redis_findings(store)
    cluster, nodes = ray_facts(settings.ray_address)
    findings += ray_findings(cluster)
    size = (ClusterSize(cluster.get("slot_nodes", 0), cluster["slots"])
            if "slots" in cluster else None)  # None: Ray did not answer
    findings += capacity_findings(store, size)
    broken = [n for n in nodes if n.get("error")]
    findings += [Finding("node", "fail", f"node {n['node']} did not answer: {n['error']}",
                         "check the node's raylet log (`ray status`)") for n in broken]
    healthy_nodes = [n for n in nodes if not n.get("error")]
    findings += versions_across_nodes([mine, *healthy_nodes] if healthy_nodes else [])
    findings += clock_skew(healthy_nodes)
    if isinstance(checkpoint_path, ObjectUrl):
        from kuangchao.platform.runtime.doctor_store import examine_store

        findings += examine_store(checkpoint_path, cluster)
    else:
        findings += storage_findings(storage_facts(checkpoint_path or kc_home() / "checkpoints"))
    findings += port_findings(port_facts(read_cluster_state()))
    return findings
