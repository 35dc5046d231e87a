"""Opening the control plane's Redis connection, and naming it in messages."""

from __future__ import annotations

import socket
import struct
from typing import Any

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from kuangchao.platform.errors import StoreUnavailable


def connect(url: str | None) -> redis.Redis:
    """Open and check a Redis connection.

    Raises:
        StoreUnavailable: When no URL is configured or Redis does not answer.
    """
    if not url:
        raise StoreUnavailable(
            "no Redis configured: set KC_REDIS_URL (e.g. redis://127.0.0.1:6379/0), "
            "or run `kc up`, which starts an embedded Valkey"
        )
    try:
        client = redis.Redis.from_url(
            url, decode_responses=True, socket_connect_timeout=5, socket_timeout=30,
            health_check_interval=30, retry=Retry(NoBackoff(), 0),
        )
        client.ping()  # fail fast, with a clear message, when Redis is not there at all
        client.set_retry(riding_retry())
    except (redis.ConnectionError, redis.TimeoutError, redis.AuthenticationError, ValueError) as exc:
        raise StoreUnavailable(
            f"cannot reach Redis at {redact(url)}: {exc}. Check that it is running, or set "
            "KC_REDIS_URL to a reachable Redis"
        ) from None
    except redis.ResponseError as exc:
        raise StoreUnavailable(f"Redis at {redact(url)} refused the connection: {exc}") from None
    return client


def riding_retry() -> Retry:
    """Retries that ride out a Redis restart (about 15 s) instead of failing the caller."""
    return Retry(ExponentialBackoff(cap=2.0, base=0.1), 12)


def abortive(client: redis.Redis) -> redis.Redis:
    """Make every connection `client` opens close with a reset (SO_LINGER 0), dropping
    whatever the kernel had not yet delivered; returns `client`.

    For a rank's own clients (its heartbeat and its log lines): on a node cut off
    from the network, a command sent during the cut waits in the kernel's send
    queue and is retransmitted for minutes, after the client gave up on it and
    after the process exited, so it would still reach Redis once the network
    heals, long after the rank was replaced (docs/fault-tolerance.md, 'Fencing').
    """
    pool = client.connection_pool
    if not getattr(pool.connection_class, "abortive", False):
        pool.connection_class = _abortive_class(pool.connection_class)
    return client


def _abortive_class(base: type) -> type:
    class Abortive(base):  # type: ignore[valid-type,misc]
        abortive = True

        def _connect(self) -> Any:
            sock = super()._connect()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return sock

    Abortive.__name__ = Abortive.__qualname__ = f"Abortive{base.__name__}"
    return Abortive


def redact(url: str) -> str:
    """The URL with any password replaced, for messages and logs."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.split('@', 1)[1]}"
