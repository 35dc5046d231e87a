"""One timed write to Redis: how a rank measures its node's link to the control plane.

The trainer's link probe (workers/trainer/links.py) writes a block of random
bytes under the job's own key space and times it. It runs on a connection of
its own, opened with the store's server and credentials but without the
store's retries: those ride out a Redis restart for seconds at a time, and a
probe must end within its timeout while the job's other ranks wait for it.
"""

from __future__ import annotations

import time
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kuangchao.platform.jobs import keys

# The probe key outlives a probe that died between its SET and its DEL only this long.
PROBE_TTL_S = 120
# Connecting and authenticating, which the probe does not time.
HANDSHAKE_TIMEOUT_S = 5.0


def timed_write(store: Any, job_id: str, node: str, payload: bytes,
                timeout_s: float) -> tuple[float, bool]:
    """Seconds one SET of `payload` took, from sending it to Redis's answer, and whether
    it finished: a write still going after `timeout_s` is given up, and its seconds
    so far bound the link's rate from above. The key is deleted after a finished
    write (an unfinished one expires). Connecting (and authenticating) is not timed.

    Raises:
        redis.RedisError, OSError: Redis could not be reached, or refused the write.
    """
    pool = store.r.connection_pool
    conn = pool.connection_class(**pool.connection_kwargs)
    # Before connecting: no retry, and the handshake (HELLO, AUTH) bounded on its own. It
    # is not the probe: a timeout of a fraction of a millisecond must not fail it.
    conn.retry = Retry(NoBackoff(), 0)
    conn.socket_timeout = conn.socket_connect_timeout = HANDSHAKE_TIMEOUT_S
    key = keys.link_probe(store.p, job_id, node)
    try:
        conn.connect()
        conn.socket_timeout = timeout_s
        sock = getattr(conn, "_sock", None)
        if sock is not None:  # the write alone is bounded by the probe's timeout
            sock.settimeout(timeout_s)
        t0 = time.perf_counter()
        try:
            conn.send_command("SET", key, payload, "EX", PROBE_TTL_S)
        except redis.TimeoutError:
            return time.perf_counter() - t0, False
        # The reply comes once Redis has every byte: wait for it within what is left.
        if not conn.can_read(timeout=max(0.0, t0 + timeout_s - time.perf_counter())):
            return time.perf_counter() - t0, False
        conn.read_response()
        took = time.perf_counter() - t0
        conn.send_command("DEL", key)
        conn.read_response()
        return took, True
    finally:
        conn.disconnect()
