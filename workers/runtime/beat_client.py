"""The Redis client a rank's heartbeat thread (and a node agent) talks through.

Short timeouts and no retries, so that a stalled Redis never holds a beat past
the next one, and connections that drop what they could not send when they
close, so that nothing begun before a network cut is delivered after the heal.
"""

from __future__ import annotations

from typing import Any

import redis

from kuangchao.platform.jobs.redis_client import abortive


def heartbeat_client(url: str, timeout_s: float) -> redis.Redis:
    """A Redis client for heartbeats: no retries inside redis-py, short timeouts, and
    connections that drop what they could not send when they close (`abortive`). Its
    writes go through the store's functions (platform/jobs/beats.py, streams.py,
    flags.py, fences.py, debug_requests.py). The store's own client rides out a Redis
    restart for seconds, which would hold beats past their TTL, and would deliver a
    write begun before a network cut after the heal: after the rank's lease."""
    limit = client_timeout_s(timeout_s)
    return abortive(redis.Redis.from_url(url, socket_connect_timeout=limit,
                                         socket_timeout=limit, decode_responses=True))


def client_timeout_s(timeout_s: float) -> float:
    """The socket timeout of a rank's short-lived Redis requests, for a heartbeat TTL."""
    return max(0.5, min(5.0, timeout_s / 3))


def socket_timeout(client: Any) -> float:
    """`client`'s socket timeout (0 for a client without one, as in tests)."""
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None) or {}
    return float(kwargs.get("socket_timeout") or 0.0)
