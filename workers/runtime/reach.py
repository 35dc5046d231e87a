"""What a rank checks first: that it can reach the control plane from its node.

On one machine everything answers on 127.0.0.1. On real hosts (or nodes in
network namespaces) a rank reaches Redis and the Ray head only at addresses
its node can route to; a wrong address or a firewall would otherwise show up
as a hang somewhere later. So each rank opens one TCP connection to each and
names, at once, whatever it could not reach and from where. Ranks never call
the API server: operators, the console and Prometheus do.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

from kuangchao.workers.errors import Unreachable

CONNECT_TIMEOUT_S = 5.0


def redis_target(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 6379


def gcs_target(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def connect_error(host: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> str:
    """The error of one TCP connection to host:port, or '' when it connected.

    Also what the controller's node probe runs on a node whose ranks went silent
    (platform/execution/reachability.py)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return ""
    except OSError as exc:
        return str(exc) or type(exc).__name__


def unreachable(targets: dict[str, tuple[str, int]],
                timeout_s: float = CONNECT_TIMEOUT_S) -> dict[str, str]:
    """Which of `targets` (what -> host, port) refuse or ignore a TCP connection,
    with the error each gave."""
    out = {}
    for what, (host, port) in targets.items():
        error = connect_error(host, port, timeout_s)
        if error:
            out[what] = f"{host}:{port}: {error}"
    return out


def check_control_plane(rank: int, node: str, redis_url: str | None) -> None:
    """Raise `Unreachable` naming each part of the control plane this rank cannot reach."""
    targets: dict[str, tuple[str, int]] = {}
    if redis_url:
        targets["Redis"] = redis_target(redis_url)
    gcs, here = "", "?"
    try:
        import ray

        if ray.is_initialized():  # inside a rank; asking otherwise would start Ray's client
            gcs = ray.get_runtime_context().gcs_address
            here = ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 -- no Ray to ask: Redis alone is checked
        pass
    if gcs:
        targets["the Ray head (GCS)"] = gcs_target(gcs)
    missing = unreachable(targets)
    if missing:
        what = "; ".join(f"{k} at {v}" for k, v in missing.items())
        raise Unreachable(
            f"rank {rank} on node {node} ({here}) cannot reach {what}. Every node must be "
            "able to open TCP connections to these addresses (docs/operator-guide.md, "
            "'Addresses and ports'); an address of 127.0.0.1 works only on one machine")
