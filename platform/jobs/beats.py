"""The ranks' heartbeats: one key per rank with a TTL (docs/fault-tolerance.md),
or one key per node where a node agent relays its ranks' beats
(platform/protocol/node_beat.py).

A rank's heartbeat thread writes its beats on a client of its own, with tight
timeouts (workers/runtime/heartbeat.py), through `queue_beat` and `drop_beat`;
a node agent through `queue_node_record`; the controller reads both through the
store."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import redis
from redis.client import NEVER_DECODE

from kuangchao.platform.jobs import keys
from kuangchao.platform.protocol.heartbeat import Beat
from kuangchao.platform.protocol.node_beat import NodeRecord, decode_node_record


def queue_beat(pipe: Any, p: str, job_id: str, rank: int, text: str, ttl_s: float) -> None:
    pipe.set(keys.beat(p, job_id, rank), text, px=int(ttl_s * 1000))


def drop_beat(client: Any, p: str, job_id: str, rank: int) -> None:
    """Take the rank's beat away at once (a clean exit is not a death)."""
    client.delete(keys.beat(p, job_id, rank))


def queue_node_record(pipe: Any, p: str, job_id: str, node: str, record: bytes,
                      ttl_s: float) -> None:
    pipe.set(keys.node_beat(p, job_id, node), record, px=int(ttl_s * 1000))


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
    with client.pipeline(transaction=False) as pipe:
        for i in range(0, len(ranks), chunk):
            pipe.mget([keys.beat(prefix, job_id, r) for r in ranks[i:i + chunk]])
        replies = pipe.execute()
    values = [v for reply in replies for v in reply]
    if cache is None:
        return {rank: Beat.decode(rank, raw) if raw is not None else None
                for rank, raw in zip(ranks, values, strict=True)}
    return _parsed(ranks, values, cache, Beat.decode)


def _parsed(names: list[Any], values: list[Any], cache: dict[Any, tuple[Any, Any]],
            parse: Callable[[Any, Any], Any]) -> dict[Any, Any]:
    """name -> parse(name, value) for each read value, None where the key was missing. A
    value equal to the one `cache` holds for the name is not parsed again."""
    out: dict[Any, Any] = {}
    for name, raw in zip(names, values, strict=True):
        if raw is None:
            out[name] = None
            continue
        hit = cache.get(name)
        if hit is not None and hit[0] == raw:
            out[name] = hit[1]
        else:
            parsed = out[name] = parse(name, raw)
            cache[name] = (raw, parsed)
    return out


def read_relayed(client: Any, prefix: str, job_id: str, nodes: list[str], ranks: list[int],
                 rank_cache: dict[int, tuple[str, Beat | None]], chunk: int = 4096
                 ) -> tuple[list[bytes | None], dict[int, Beat | None]]:
    """The agents' records of `nodes`, as stored (bytes: the client does not decode
    them, RelayView compares and decodes them in bulk), and the own beats of `ranks`
    (`rank_cache` as in `read_beats`), in one pipelined round trip; None where a key
    expired."""
    with client.pipeline(transaction=False) as pipe:
        for i in range(0, len(nodes), chunk):
            pipe.execute_command("MGET", *(keys.node_beat(prefix, job_id, n)
                                           for n in nodes[i:i + chunk]), **{NEVER_DECODE: True})
        for i in range(0, len(ranks), chunk):
            pipe.mget([keys.beat(prefix, job_id, r) for r in ranks[i:i + chunk]])
        replies = pipe.execute()
    values = [v for reply in replies for v in reply]
    return values[:len(nodes)], _parsed(ranks, values[len(nodes):], rank_cache, Beat.decode)


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

    def relayed_raw(self, job_id: str, nodes: list[str], ranks: list[int],
                    rank_cache: dict[int, tuple[str, Beat | None]]
                    ) -> tuple[list[bytes | None], dict[int, Beat | None]]:
        """The node agents' records as stored, and the named ranks' own beats
        (`read_relayed`): what the controller's scan reads."""
        return read_relayed(self.r, self.p, job_id, nodes, ranks, rank_cache)

    def relayed_beats(self, job_id: str, nodes: list[str], ranks: list[int]
                      ) -> tuple[dict[str, NodeRecord | None], dict[int, Beat | None]]:
        """The node agents' records, decoded, and the named ranks' own beats (for a
        look at one node; the scan uses `relayed_raw`)."""
        raws, direct = read_relayed(self.r, self.p, job_id, nodes, ranks, {})
        return ({n: decode_node_record(v) if v is not None else None
                 for n, v in zip(nodes, raws, strict=True)}, direct)

    def put_node_record(self, job_id: str, node: str, record: bytes, ttl_s: float) -> None:
        queue_node_record(self.r, self.p, job_id, node, record, ttl_s)
