"""The ranks' heartbeats: one key per rank with a TTL (docs/fault-tolerance.md).

A rank's heartbeat thread writes its beats on a client of its own, with tight
timeouts (workers/runtime/heartbeat.py), through `queue_beat` and `drop_beat`;
the controller reads them through the store."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import redis

from kuangchao.platform.jobs import keys

if TYPE_CHECKING:
    from kuangchao.platform.execution.heartbeat import Beat


def queue_beat(pipe: Any, p: str, job_id: str, rank: int, text: str, ttl_s: float) -> None:
    pipe.set(keys.beat(p, job_id, rank), text, px=int(ttl_s * 1000))


def drop_beat(client: Any, p: str, job_id: str, rank: int) -> None:
    """Take the rank's beat away at once (a clean exit is not a death)."""
    client.delete(keys.beat(p, job_id, rank))


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
        from kuangchao.platform.execution.heartbeat import read_beats  # pure; read by the controller

        return read_beats(self.r, self.p, job_id, ranks, cache=cache)
