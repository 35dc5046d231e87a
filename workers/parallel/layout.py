"""Where a rank sits in the job's 3-D layout, and the device mesh over it.

Ranks are numbered `rank = (dp_index * pp + stage) * tp + tp_index`, the order
placement uses (platform/placement/solver.py): a tensor-parallel group is a run of
consecutive ranks, which placement keeps inside one NVLink island, and a
data-parallel replica (one pipeline) is a run of `pp * tp` ranks. The mesh's
dimensions are therefore ("dp", "pp", "tp"), row-major.

With HSDP (`shard_group_size` s under ZeRO 2 or 3) the data-parallel dimension
splits in two, row-major: `dp_index = group * s + member`, so a sharding group is
s consecutive data-parallel indices (one node, or one island, when placement
keeps them together) and the mesh is ("dp_replicate", "dp_shard", "pp", "tp").

With expert parallelism (`expert_parallel_size` ep) it splits the same way:
`dp_index = edp * ep + e`, an expert-parallel group being ep consecutive
data-parallel indices, and the mesh is ("edp", "ep", "pp", "tp")
(workers/parallel/expert_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from kuangchao.platform.spec.parallel import ParallelSection


@dataclass(frozen=True)
class Coords:
    """One rank's coordinates in a (dp, pp, tp) layout."""

    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class Layout:
    """The sizes of the three dimensions, at the job's current data-parallel size."""

    dp: int
    pp: int = 1
    tp: int = 1
    # HSDP: data-parallel ranks per sharding group, below dp; None: one group (plain
    # FSDP, or no sharding at all).
    shard_group: int | None = None
    # Expert parallelism: data-parallel ranks the experts are split over.
    ep: int = 1

    def __post_init__(self) -> None:
        if self.dp % self.ep:
            raise ValueError(f"{self.ep} expert-parallel ranks do not divide {self.dp} "
                             "data-parallel ranks")
        s = self.shard_group
        if s is not None and not (1 <= s < self.dp and self.dp % s == 0):
            raise ValueError(f"sharding groups of {s} do not split {self.dp} data-parallel ranks "
                             "into two or more whole groups")

    @classmethod
    def of(cls, parallel: ParallelSection, world_size: int) -> Layout:
        """The layout for `world_size` ranks; an elastic job changes only `dp`.

        A `shard_group_size` equal to dp is one group: plain FSDP, wired as such."""
        per_replica = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        if world_size % per_replica:
            raise ValueError(f"{world_size} ranks do not split into replicas of "
                             f"{per_replica} (tensor x pipeline parallel)")
        dp = world_size // per_replica
        s = parallel.shard_group_size if parallel.zero_stage >= 2 else None
        return cls(dp, parallel.pipeline_parallel_size, parallel.tensor_parallel_size,
                   s if s != dp else None, parallel.expert_parallel_size)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def shard_groups(self) -> int:
        """How many sharding groups the data-parallel ranks form (1 without HSDP)."""
        return self.dp // self.shard_group if self.shard_group else 1

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a layout of {self.world_size} ranks")
        return Coords(rank // (self.pp * self.tp), rank // self.tp % self.pp, rank % self.tp)

    def rank(self, c: Coords) -> int:
        return (c.dp * self.pp + c.pp) * self.tp + c.tp

    def dp_group(self, rank: int) -> list[int]:
        """The ranks holding the same model shard as `rank`: its data-parallel peers."""
        c = self.coords(rank)
        return [self.rank(Coords(d, c.pp, c.tp)) for d in range(self.dp)]

    def shard_group_of(self, rank: int) -> list[int]:
        """The data-parallel peers `rank` shards parameters, gradients and optimizer state
        with: its whole dp group without HSDP, else its run of `shard_group` of them."""
        peers = self.dp_group(rank)
        if not self.shard_group:
            return peers
        first = self.coords(rank).dp // self.shard_group * self.shard_group
        return peers[first:first + self.shard_group]

    def replica_group_of(self, rank: int) -> list[int]:
        """The ranks holding the same shard as `rank` under HSDP, one per sharding group
        (gradients are all-reduced over them); `[rank]` without HSDP."""
        if not self.shard_group:
            return [rank]
        peers = self.dp_group(rank)
        return peers[self.coords(rank).dp % self.shard_group::self.shard_group]

    def ep_group(self, rank: int) -> list[int]:
        """The ranks `rank` splits its experts with: ep consecutive data-parallel peers."""
        peers = self.dp_group(rank)
        first = self.coords(rank).dp // self.ep * self.ep
        return peers[first:first + self.ep]

    def expert_dp_group(self, rank: int) -> list[int]:
        """The ranks holding the same experts as `rank`, one per expert-parallel group."""
        return self.dp_group(rank)[self.coords(rank).dp % self.ep::self.ep]

    def pp_group(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return [self.rank(Coords(c.dp, s, c.tp)) for s in range(self.pp)]

    def tp_group(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return [self.rank(Coords(c.dp, c.pp, t)) for t in range(self.tp)]

    def stage_chunks(self, stage: int, virtual_stages: int) -> list[int]:
        """The model chunks a pipeline rank runs: stage s, s + pp, ... (interleaved order)."""
        return [stage + v * self.pp for v in range(virtual_stages)]


def chunk_layers(n_layers: int, chunks: int, chunk: int,
                 split: tuple[int, ...] | None = None) -> range:
    """The blocks model chunk `chunk` of `chunks` holds: equal runs of whole layers, or
    with `split` (layers per chunk, from the stages' speeds: workers/parallel/balance.py)
    the run `split[chunk]` long after the chunks before it."""
    if split is not None:
        if len(split) != chunks or sum(split) != n_layers or min(split) < 1:
            raise ValueError(f"layer split {list(split)} does not cut {n_layers} layers into "
                             f"{chunks} chunks of at least one")
        start = sum(split[:chunk])
        return range(start, start + split[chunk])
    if n_layers % chunks:
        raise ValueError(f"{chunks} model chunks do not divide {n_layers} layers")
    per = n_layers // chunks
    return range(chunk * per, (chunk + 1) * per)


def node_groups(dp_ranks: list[int], node_of: dict[int, str]) -> list[list[int]] | None:
    """Split a data-parallel group by node, for the hierarchical all-reduce.

    Returns the per-node groups (in the order of their first rank), or None
    when the hierarchy does not apply: one node, every rank on its own node,
    or nodes holding different numbers of the group's ranks (the cross-node
    step pairs the i-th rank of every node, so all nodes need the same count).
    """
    by_node: dict[str, list[int]] = {}
    for r in dp_ranks:
        by_node.setdefault(node_of[r], []).append(r)
    groups = list(by_node.values())
    sizes = {len(g) for g in groups}
    if len(groups) < 2 or len(sizes) != 1 or sizes == {1}:
        return None
    return groups
