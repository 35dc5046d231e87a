"""GPU pools: the live nodes of one GPU type, and which pool a one-type job goes to.

Shared clusters mix GPU generations. A job that keeps all its ranks on one type
(`resources.heterogeneous: false`, the default) runs every step at the pace of
its slowest GPU, so mixing would waste the fast ones; it therefore runs inside
one pool. Which one:

- **Some pool can place it now:** the first such pool in the job's order of
  preference: the order the user listed its `gpu_types` in (they said which
  they would rather have), then the faster type (the catalogue's achieved
  FLOP/s, `peak_flops x mfu_ceiling`), then the name; untyped nodes last.
- **None can:** the pool whose queue ahead of the job is shortest, i.e. the
  GPUs that jobs queued ahead of it could claim there (`queue_ahead`); the
  GPUs already in use there break ties, since they are what must finish
  first. The job waits for that pool, and only that pool's GPUs are held
  for it, so a job never blocks two pools at once.

An untyped node (no `kc.io/gpu-type`) serves only jobs that list no type: it
cannot be shown to be what a typed job asked for.

Pure: topology values and the hardware catalogue only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kuangchao.platform.cluster.hardware import CATALOG
from kuangchao.platform.cluster.topology import NodeInfo

UNTYPED = "untyped"  # the pool name of nodes without a GPU type (no catalogue key has it)


def accepts(gpu_types: Sequence[str], gpu_type: str | None) -> bool:
    """Whether a node of `gpu_type` may hold ranks of a job listing `gpu_types`
    (none listed: any node, untyped ones included)."""
    return not gpu_types or gpu_type in gpu_types


def speed(gpu_type: str | None) -> float:
    """Achieved FLOP/s of one GPU of this type (0 when unknown): what a faster
    pool is judged by, the same measure the trainer balances work with."""
    acc = CATALOG.get(gpu_type or "")
    return acc.peak_flops * acc.mfu_ceiling if acc is not None else 0.0


def preference(gpu_types: Sequence[str], gpu_type: str | None) -> tuple:
    """Sort key of a type for a job listing `gpu_types`: listed order, then the
    fastest, then the name; untyped last."""
    listed = gpu_types.index(gpu_type) if gpu_type in gpu_types else len(gpu_types)
    return (gpu_type is None, listed, -speed(gpu_type), gpu_type or "")


@dataclass(frozen=True)
class Pool:
    """The live nodes of one GPU type that a job accepts."""

    gpu_type: str | None
    nodes: tuple[NodeInfo, ...]

    @property
    def name(self) -> str:
        return self.gpu_type or UNTYPED

    @property
    def gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    def in_use(self, used: Mapping[str, set[int]]) -> int:
        """GPUs taken on this pool's nodes."""
        return sum(len(used.get(n.name, ())) for n in self.nodes)


def pools_of(nodes: Iterable[NodeInfo], gpu_types: Sequence[str] = ()) -> list[Pool]:
    """The live nodes a job listing `gpu_types` accepts, one pool per type, in
    the job's order of preference."""
    by_type: dict[str | None, list[NodeInfo]] = {}
    for n in nodes:
        if n.alive and accepts(gpu_types, n.gpu_type):
            by_type.setdefault(n.gpu_type, []).append(n)
    return [Pool(t, tuple(ns)) for t, ns in
            sorted(by_type.items(), key=lambda kv: preference(gpu_types, kv[0]))]


def no_pool_reason(nodes: Iterable[NodeInfo], gpu_types: Sequence[str]) -> str:
    """Why a job listing `gpu_types` has no live node to run on."""
    present = sorted({n.gpu_type or UNTYPED for n in nodes if n.alive})
    return (f"no live node has GPU type {' or '.join(gpu_types)} (the live nodes have "
            f"{', '.join(present) or 'none'}); list one of those in resources.gpu_types")


def capacity_problem(nodes: Iterable[NodeInfo], gpu_types: Sequence[str], heterogeneous: bool,
                     gpus: int) -> str | None:
    """Why a job of these types could never get `gpus` GPUs on these nodes, or None.

    A one-type job is bounded by its largest pool, a mixed one by all its
    pools together. Such a job must not hold GPUs back from others while it
    waits for capacity that does not exist.
    """
    nodes = tuple(nodes)
    pools = pools_of(nodes, gpu_types)
    if not pools:
        return no_pool_reason(nodes, gpu_types) if gpu_types else (
            f"needs {gpus} GPUs, the cluster has 0" if gpus > 0 else None)
    whole = sum(n.gpus for n in nodes if n.alive)
    if heterogeneous or len(pools) == 1:
        have = sum(p.gpus for p in pools)
        if gpus <= have:
            return None
        if have == whole:
            return f"needs {gpus} GPUs, the cluster has {whole}"
        return f"needs {gpus} GPUs, nodes of {'/'.join(p.name for p in pools)} have {have}"
    big = max(pools, key=lambda p: p.gpus)
    if gpus <= big.gpus:
        return None
    return (f"needs {gpus} GPUs of one type; the largest pool ({big.name}) has {big.gpus} "
            "(set resources.heterogeneous: true to mix types)")


def island_problem(nodes: Iterable[NodeInfo], gpu_types: Sequence[str], tp: int,
                   gpus_per_rank: int) -> tuple[str, str] | None:
    """`(field, message)` when a tensor-parallel group, or a single rank, can fit no
    node of the accepted types; None when it fits, or when no node is known.

    A tensor-parallel group must sit in one NVLink island of one node, and so on
    one GPU type; a single rank (tp 1) needs its GPUs on one node. Dead nodes
    count: they may come back, and the scheduler explains waits for them.
    """
    known = [n for n in nodes if accepts(gpu_types, n.gpu_type)]
    if not known or gpus_per_rank <= 0:
        return None
    need = tp * gpus_per_rank
    if tp > 1:
        size, node = max(((len(isl), n) for n in known for isl in n.islands),
                         key=lambda x: (x[0], x[1].gpu_type is not None), default=(0, known[0]))
        if need <= size:
            return None
        on = f" on {node.gpu_type} nodes" if node.gpu_type else ""
        return ("parallel.tensor_parallel_size",
                f"{need} GPUs per tensor-parallel group ({tp} x {gpus_per_rank} GPUs per rank) "
                f"do not fit the largest single-type NVLink island ({size} GPUs{on}); "
                + (f"lower parallel.tensor_parallel_size to {size // gpus_per_rank} or less"
                   if size >= gpus_per_rank else "lower parallel.gpus_per_rank")
                + ", or list a GPU type with larger islands in resources.gpu_types")
    big = max(known, key=lambda n: n.gpus)
    if need <= big.gpus:
        return None
    on = f" ({big.gpu_type})" if big.gpu_type else ""
    return ("parallel.gpus_per_rank",
            f"a rank needs {need} GPUs on one node; the largest node{on} has {big.gpus}; "
            f"lower parallel.gpus_per_rank to {big.gpus} or less")


@dataclass(frozen=True)
class Ahead:
    """A job queued ahead of the one choosing a pool: the GPUs it could claim, and where.

    Attributes:
        gpus: GPUs it asks for (at its target size).
        gpu_types: The types it accepts (empty: any).
        pool: The pool it already waits for, if it chose one this cycle: it
            claims only there.
    """

    gpus: int
    gpu_types: tuple[str, ...] = ()
    pool: str | None = None

    def claims(self, pool: Pool) -> int:
        """GPUs it could take from `pool` before the job behind it gets any."""
        mine = pool.name == self.pool if self.pool is not None else accepts(
            self.gpu_types, pool.gpu_type)
        return min(self.gpus, pool.gpus) if mine else 0


def queue_ahead(pool: Pool, ahead: Iterable[Ahead]) -> int:
    """The GPUs jobs queued ahead could claim in `pool`."""
    return sum(a.claims(pool) for a in ahead)


def wait_pool(candidates: Sequence[Pool], ahead: Sequence[Ahead],
              used: Mapping[str, set[int]]) -> Pool:
    """The pool to wait for, among `candidates` (pools that could hold the job once
    free, in order of preference): the shortest queue ahead, then the fewest GPUs
    in use, then preference."""
    return min(enumerate(candidates),
               key=lambda ip: (queue_ahead(ip[1], ahead), ip[1].in_use(used), ip[0]))[1]
