"""Peer-memory checkpoints, the decisions: what a keeper holds, which step a job
restores from its peers' memory, and which nodes keep a rank's copies.

With `checkpoint.in_memory` a rank pushes its state every `interval_steps` steps,
serialized, to a *keeper* (a small Ray actor, one per job per node:
platform/execution/keeper.py) on its own node and to `replicas` keepers on other
nodes (workers/checkpoint/peer_memory.py). A replacement rank restores from them
when every rank has a copy of one step at least as new as the disk's newest
checkpoint, and from disk otherwise.

Pure: no torch, Ray or Redis, so that the keeper, the ranks and the controller
share one set of rules and unit tests need none of them.

Why these rules:
- A copy is checksummed (CRC-32, as the disk checkpoints' files: it has to catch
  bit rot and torn transfers, not tampering, which the capability token on every
  keeper call guards) and carries the layout it was written under (world size and
  spec hash): a copy from another layout does not load into this one's shards.
- A keeper keeps the *two* newest copies of each rank. A failure can land while the
  ranks push step N: some keepers then hold N for some ranks only, and N-1 is the
  newest step every rank still has. One copy would leave nothing common then.
- One copy is bounded by `max_mb_per_rank`, so a keeper holds at most
  2 x that x the ranks it keeps copies of: the spec bounds the memory.
- A rank goes back in steps only after a restore (a failure, a rollback), and
  whatever it held past that step belongs to the abandoned run: a put of step S
  drops the rank's copies newer than S. A put under a new layout (a resize) drops
  the rank's copies of the old one.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kuangchao.platform.errors import CopyRefused
from kuangchao.platform.settings import RAY_NAMESPACE

# Copies a keeper keeps per rank (see the module doc for why two).
KEEP_PER_RANK = 2
KEEPER_PREFIX = "kc-keeper"


def keeper_name(job_id: str, node: str) -> str:
    """The Ray actor name of the job's keeper on `node` (kc.io/node name): the
    controller starts it under this name, a rank finds it by it."""
    return f"{KEEPER_PREFIX}:{job_id}:{node}"


def keeper_prefix(job_id: str) -> str:
    """What every keeper name of the job starts with (to find them all)."""
    return f"{KEEPER_PREFIX}:{job_id}:"


@dataclass(frozen=True)
class KeeperPlan:
    """What a rank is told of its job's keepers: each node's keeper by name, and each
    rank's node (for `peers_for`). The controller makes it from its placement and
    `start_keepers`' answer and hands it to every rank with `run`; a rank without one
    (None) pushes no copies and restores from disk only."""

    keepers: Mapping[str, str]  # node -> keeper actor name
    node_of: Mapping[int, str]  # rank -> node
    namespace: str = RAY_NAMESPACE

    def to_json(self) -> dict[str, Any]:
        return {"keepers": dict(self.keepers),
                "node_of": {str(r): n for r, n in sorted(self.node_of.items())},
                "namespace": self.namespace}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> KeeperPlan:
        return cls(keepers={str(n): str(a) for n, a in doc["keepers"].items()},
                   node_of={int(r): str(n) for r, n in doc["node_of"].items()},
                   namespace=str(doc.get("namespace") or RAY_NAMESPACE))


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The CRC-32 of a copy's bytes."""
    return zlib.crc32(data) & 0xFFFFFFFF


def mb(size: int) -> str:
    return f"{size / (1024 * 1024):.1f} MB"


@dataclass(frozen=True)
class CopyLayout:
    """What a copy was written under; it loads only into the same."""

    world_size: int
    spec_hash: str

    def to_json(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "spec_hash": self.spec_hash}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> CopyLayout:
        return cls(int(doc["world_size"]), str(doc["spec_hash"]))


@dataclass(frozen=True)
class CopyMeta:
    """One copy, without its bytes: which rank and step, its size, checksum and layout."""

    rank: int
    step: int
    size: int
    crc32: int
    layout: CopyLayout
    stored_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, "size": self.size, "crc32": self.crc32,
                "layout": self.layout.to_json(), "stored_at": self.stored_at}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> CopyMeta:
        try:
            return cls(int(doc["rank"]), int(doc["step"]), int(doc["size"]), int(doc["crc32"]),
                       CopyLayout.from_json(doc["layout"]), float(doc.get("stored_at", 0.0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise CopyRefused("malformed", f"a copy's description is incomplete ({exc!r})") from None


def mismatch(meta: CopyMeta, data: bytes | bytearray | memoryview | None,
             layout: CopyLayout | None = None) -> str | None:
    """Why a copy may not be restored (its bytes or its layout are not what they must
    be), or None when it may. `layout`: the restoring rank's own."""
    if data is None:
        return f"rank {meta.rank}'s copy of step {meta.step} came without its bytes"
    if len(data) != meta.size:
        return (f"rank {meta.rank}'s copy of step {meta.step} is {len(data)} bytes, "
                f"{meta.size} were written")
    if checksum(data) != meta.crc32:
        return (f"rank {meta.rank}'s copy of step {meta.step} fails its CRC-32 (altered in memory "
                "or on the way)")
    return layout_mismatch(meta, layout) if layout is not None else None


def layout_mismatch(meta: CopyMeta, layout: CopyLayout) -> str | None:
    """Why a copy does not load under `layout` (the restoring rank's), or None."""
    if meta.layout == layout:
        return None
    return (f"rank {meta.rank}'s copy of step {meta.step} was written by {meta.layout.world_size} "
            f"ranks under spec {meta.layout.spec_hash}; this run is {layout.world_size} ranks "
            f"under spec {layout.spec_hash}")


class CopyStore:
    """What one keeper holds for one job: copies keyed by (rank, step).

    Args:
        max_bytes: The bound on one copy (`checkpoint.in_memory.max_mb_per_rank`).
        keep: Copies kept per rank (two: see the module doc).
        clock: For `stored_at`.
    """

    def __init__(self, max_bytes: int, keep: int = KEEP_PER_RANK, clock: Any = time.time) -> None:
        if max_bytes < 1 or keep < 1:
            raise ValueError("a copy store needs a positive bound and keeps at least one copy")
        self.max_bytes, self.keep, self._clock = max_bytes, keep, clock
        self._copies: dict[tuple[int, int], tuple[CopyMeta, bytes]] = {}

    def put(self, meta: CopyMeta, data: bytes) -> list[int]:
        """Keep `data` as `meta` describes it; returns the steps of the rank's copies it
        dropped (the oldest beyond `keep`, newer ones of an abandoned run, other layouts').

        Raises:
            CopyRefused: A copy over the bound (too_large) or whose bytes are not what
                `meta` says (checksum); what was held stays.
        """
        if meta.size > self.max_bytes or len(data) > self.max_bytes:
            raise CopyRefused("too_large", (
                f"rank {meta.rank}'s copy of step {meta.step} is {mb(max(meta.size, len(data)))}, over "
                f"checkpoint.in_memory.max_mb_per_rank ({mb(self.max_bytes)}); raise it, or "
                "leave this job to its disk checkpoints"))
        if meta.rank < 0 or meta.step < 0:
            raise CopyRefused("malformed", f"rank {meta.rank}, step {meta.step}: both must be >= 0")
        problem = mismatch(meta, data)
        if problem is not None:
            raise CopyRefused("checksum", problem)
        dropped = [s for (r, s), (m, _) in self._copies.items()
                   if r == meta.rank and (s > meta.step or m.layout != meta.layout)]
        for s in dropped:
            del self._copies[meta.rank, s]
        stored = CopyMeta(meta.rank, meta.step, meta.size, meta.crc32, meta.layout, self._clock())
        self._copies[meta.rank, meta.step] = (stored, bytes(data))
        steps = sorted(self.steps(meta.rank), reverse=True)
        for s in steps[self.keep:]:
            del self._copies[meta.rank, s]
            dropped.append(s)
        return sorted(dropped)

    def get(self, rank: int, step: int) -> tuple[CopyMeta, bytes] | None:
        return self._copies.get((rank, step))

    def list(self, rank: int | None = None) -> list[CopyMeta]:
        """The copies held (of one rank, or all), by rank then step."""
        return [m for (r, _), (m, _) in sorted(self._copies.items()) if rank is None or r == rank]

    def steps(self, rank: int, layout: CopyLayout | None = None) -> set[int]:
        """The steps held for `rank` (only those written under `layout`, when given)."""
        return {s for (r, s), (m, _) in self._copies.items()
                if r == rank and (layout is None or m.layout == layout)}

    def drop(self, rank: int | None = None, step: int | None = None) -> int:
        """Forget copies (of one rank, of one step, or all); returns the bytes freed."""
        gone = [k for k in self._copies
                if (rank is None or k[0] == rank) and (step is None or k[1] == step)]
        freed = sum(self._copies[k][0].size for k in gone)
        for k in gone:
            del self._copies[k]
        return freed

    def bytes_held(self) -> int:
        return sum(m.size for m, _ in self._copies.values())

    def ranks(self) -> set[int]:
        return {r for r, _ in self._copies}

    def stats(self) -> dict[str, Any]:
        """What the controller reads for its metrics: bytes and copies held, the most
        this store may hold for the ranks it keeps (`keep` copies each), and which
        steps it holds of each rank (no contents)."""
        ranks = self.ranks()
        return {"bytes": self.bytes_held(), "copies": len(self._copies), "ranks": len(ranks),
                "bound_bytes": self.keep * self.max_bytes * len(ranks),
                "steps": {str(r): sorted(self.steps(r)) for r in sorted(ranks)}}


def choose_restore(disk_step: int | None, available: Mapping[int, Iterable[int]],
                   world_size: int) -> int | None:
    """The step to restore from peers' memory: the newest step every rank has a copy
    of, if it is at least the disk's newest step; else None (restore from disk).

    Args:
        disk_step: The newest step of the disk checkpoints (None: there is none). A
            caller may pass the newest *committed* step before verifying it: a copy at
            least that new is at least as new as any disk checkpoint that verifies,
            and the caller spares reading the whole checkpoint to checksum it.
        available: For each rank, the steps of its copies that can be restored (the
            layout matches, the bytes verify or are yet to be fetched).
        world_size: The ranks that must all have the step: 0 .. world_size-1.
    """
    if world_size < 1:
        return None
    common: set[int] | None = None
    for rank in range(world_size):
        steps = set(available.get(rank, ()))
        common = steps if common is None else common & steps
        if not common:
            return None
    step = max(common) if common else None
    if step is None or (disk_step is not None and step < disk_step):
        return None
    return step


def _local_index(rank: int, node_of: Mapping[int, str]) -> int:
    """`rank`'s position among the ranks on its node, in rank order."""
    node = node_of[rank]
    return sorted(r for r, n in node_of.items() if n == node).index(rank)


def peers_for(rank: int, node_of: Mapping[int, str], replicas: int) -> list[str]:
    """The `replicas` other nodes that keep `rank`'s copies (its own node keeps one too).

    Spread evenly and deterministically: the nodes in a ring (sorted by name), and
    the k-th rank of a node (in rank order) takes `replicas` consecutive nodes of
    the ring after its own, starting k x `replicas` along. With the same number of
    ranks on every node, every node then keeps exactly as many copies as it sends
    out; otherwise the counts differ by the ranks that differ.

    With fewer other nodes than `replicas`, every other node (`peer_shortfall` says so).

    Raises:
        KeyError: `rank` is not in `node_of`.
    """
    if replicas < 1:
        return []
    ring = sorted(set(node_of.values()))
    own = ring.index(node_of[rank])
    others = ring[own + 1:] + ring[:own]
    if not others:
        return []
    start = _local_index(rank, node_of) * replicas
    count = min(replicas, len(others))
    return [others[(start + i) % len(others)] for i in range(count)]


def peer_shortfall(node_of: Mapping[int, str], replicas: int) -> str | None:
    """What a job with fewer other nodes than `replicas` gets instead, in words; else None."""
    others = len(set(node_of.values())) - 1
    if others >= replicas:
        return None
    if others <= 0:
        return (f"checkpoint.in_memory.replicas is {replicas}, but the job runs on one node: "
                "each rank's copy is kept on its own node only, which outlives the rank's "
                "process but not the node")
    return (f"checkpoint.in_memory.replicas is {replicas}, but the job runs on {others + 1} "
            f"nodes: each rank's copy goes to the {others} other node(s)")


def keeper_load(node_of: Mapping[int, str], replicas: int) -> dict[str, int]:
    """How many ranks' copies each node's keeper holds (its own ranks' and its peers')."""
    load = dict.fromkeys(set(node_of.values()), 0)
    for rank, node in node_of.items():
        for n in (node, *peers_for(rank, node_of, replicas)):
            load[n] += 1
    return load
