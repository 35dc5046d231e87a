"""Where a rank sits in the job's 3-D layout, and the device mesh over it.

Ranks are numbered `rank = (dp_index * pp + stage) * tp + tp_index`, the order
placement uses (platform/placement/solver.py): a tensor-parallel group is a run of
consecutive ranks, which placement keeps inside one NVLink island, and a
data-parallel replica (one pipeline) is a run of `pp * tp` ranks. The mesh's
dimensions are therefore ("dp", "pp", "tp"), row-major.
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

    @classmethod
    def of(cls, parallel: ParallelSection, world_size: int) -> Layout:
        """The layout for `world_size` ranks; an elastic job changes only `dp`."""
        per_replica = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        if world_size % per_replica:
            raise ValueError(f"{world_size} ranks do not split into replicas of "
                             f"{per_replica} (tensor x pipeline parallel)")
        return cls(world_size // per_replica, parallel.pipeline_parallel_size,
                   parallel.tensor_parallel_size)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

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

    def pp_group(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return [self.rank(Coords(c.dp, s, c.tp)) for s in range(self.pp)]

    def tp_group(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return [self.rank(Coords(c.dp, c.pp, t)) for t in range(self.tp)]

    def stage_chunks(self, stage: int, virtual_stages: int) -> list[int]:
        """The model chunks a pipeline rank runs: stage s, s + pp, ... (interleaved order)."""
        return [stage + v * self.pp for v in range(virtual_stages)]


def chunk_layers(n_layers: int, chunks: int, chunk: int) -> range:
    """The blocks model chunk `chunk` of `chunks` holds (equal runs of whole layers)."""
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
