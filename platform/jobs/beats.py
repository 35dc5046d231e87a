"""The ranks' heartbeats: one key per rank with a TTL (docs/fault-tolerance.md).

A rank's heartbeat thread writes its beats on a client of its own, with tight
timeouts (workers/runtime/heartbeat.py), through `queue_beat` and `drop_beat`;
the controller reads them through the store."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis

from kuangchao.platform.jobs import keys
from kuangchao.platform.protocol.heartbeat import Beat


def queue_beat(pipe: Any, p: str, job_id: str, rank: int, text: str, ttl_s: float) -> None:
    pipe.set(keys.beat(p, job_id, rank), text, px=int(ttl_s * 1000))


def drop_beat(client: Any, p: str, job_id: str, rank: int) -> None:
    """Take the rank's beat away at once (a clean exit is not a death)."""
    client.delete(keys.beat(p, job_id, rank))


def read_beats(client, prefix: str, job_id: str, ranks: Iterable[int], chunk: int = 4096,
               cache: dict[int, tuple[str, Beat | None]] | None = None) -> dict[int, Beat | None]:
    """All ranks' current beats: one MGET per chunk of ranks, all in one pipelined round trip.

    Args:
        cache: Kept by the caller between scans: a value that has not changed
            since the last scan is not parsed again. Beats come once per
            interval and the controller polls twice as often, so about half
            the values are unchanged in any scan.
    """
    ranks = list(ranks)
    out: dict[int, Beat | None] = {}
    with client.pipeline(transaction=False) as pipe:
        for i in range(0, len(ranks), chunk):
            pipe.mget([keys.beat(prefix, job_id, r) for r in ranks[i:i + chunk]])
        replies = pipe.execute()
    values = [v for reply in replies for v in reply]
    if cache is None:
        for rank, raw in zip(ranks, values, strict=True):
            out[rank] = Beat.decode(rank, raw) if raw is not None else None
        return out
    for rank, raw in zip(ranks, values, strict=True):
        if raw is None:
            out[rank] = None
            continue
        hit = cache.get(rank)
        if hit is not None and hit[0] == raw:
            out[rank] = hit[1]
        else:
            beat = out[rank] = Beat.decode(rank, raw)
            cache[rank] = (raw, beat)
    return out


class Beats:
    """The heartbeats part of `JobStore`."""

    r: redis.Redis
    p: str

    def put_beat(self, job_id: str, rank: int, text: str, ttl_s: float) -> None:
        """Store a rank's encoded beat (`Beat.encode()`) for `ttl_s`."""
        queue_beat(self.r, self.p, job_id, rank, text, ttl_s)

    def drop_beat(self, job_id: str, rank: int) -> None:
        drop_beat(self.r, self.p, job_id, rank)

    def beats(self, job_id: str, ranks: Iterable[int],
              cache: dict[int, tuple[str, Beat | None]] | None = None) -> dict[int, Beat | None]:
        """Each rank's current beat, None where its key expired; `cache` as in `read_beats`."""
        return read_beats(self.r, self.p, job_id, ranks, cache=cache)
