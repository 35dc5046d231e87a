"""Plans across GPU pools: one pool of a type, or a mix of pools of several types.

Pure (stdlib only). A pool is GPUs of one catalogue type (`16xh100-80gb`). The
planner compares each pool alone (`planner.plan` on it) with mixes of pools
(`mix.plan_mix`): data-parallel replicas spread over the pools, each replica's
tp x pp ranks within one type, and the global batch split by each type's speed.
docs/parallelism.md, "Plans across GPU pools", states the rules.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any

from kuangchao.platform.cluster.hardware import CATALOG, Accelerator, get_accelerator
from kuangchao.platform.planning.planner import SCHEDULES, TIE_S, describe, plan
from kuangchao.platform.planning.shapes import ClusterShape, ModelShape, Plan

BALANCES = ("speed", "even")
_POOL = re.compile(r"^\s*(\d+)\s*[xX*]\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*$")
POOL_SYNTAX = "COUNTxTYPE pools joined by commas, e.g. 16xh100-80gb,16xa100-80gb"


def speed(acc: Accelerator) -> float:
    """Achieved FLOP/s of one GPU on training GEMMs, `peak_flops x mfu_ceiling`: what
    work is balanced by (hardware.speed_of, for any entry including calibrated copies)."""
    return acc.peak_flops * acc.mfu_ceiling


@dataclass(frozen=True)
class Pool:
    """`gpus` GPUs of one type, in nodes of `gpus_per_node` (default: the type's usual node)."""

    acc: Accelerator
    gpus: int
    gpus_per_node: int | None = None

    def __post_init__(self) -> None:
        self.shape  # noqa: B018 -- validates the count against the node size

    @property
    def shape(self) -> ClusterShape:
        return ClusterShape(self.gpus, self.gpus_per_node or self.acc.gpus_per_node)

    @property
    def speed(self) -> float:
        return speed(self.acc)

    @property
    def label(self) -> str:
        return f"{self.gpus} x {self.acc.name}"


@dataclass(frozen=True)
class PoolShare:
    """One pool's part of a plan: its replicas and its share of the global batch."""

    pool: Pool
    dp: int  # data-parallel replicas on this pool
    sequences: int  # of the global batch, per step
    micro_batches: int  # per replica (the most any of its replicas gets)
    memory_gb_per_gpu: float
    busy_s: float  # a replica's compute, TP and pipeline time, before the data-parallel sync

    def to_json(self, global_batch: int) -> dict[str, Any]:
        return {"gpu": self.pool.acc.name, "gpus": self.pool.gpus,
                "gpus_per_node": self.pool.shape.node_size, "dp": self.dp,
                "share": round(self.sequences / global_batch, 4), "sequences": self.sequences,
                "micro_batches": self.micro_batches,
                "memory_gb_per_gpu": round(self.memory_gb_per_gpu, 2), "busy_s": round(self.busy_s, 6)}


@dataclass(frozen=True)
class PoolPlan:
    """A plan on one pool or a mix. `plan` is the concrete layout over all of its GPUs
    (dp is every pool's replicas together; memory the most any type needs); its
    `predicted_step_s` is the balanced or the even split's, as the search was asked."""

    plan: Plan
    shares: tuple[PoolShare, ...]
    balanced_step_s: float
    even_step_s: float

    @property
    def mixed(self) -> bool:
        return len(self.shares) > 1

    @property
    def gpu(self) -> str:
        """The type, or the types of a mix joined by '+' (e.g. h100-80gb+a100-80gb)."""
        return "+".join(s.pool.acc.name for s in self.shares)

    @property
    def gpus(self) -> int:
        return sum(s.pool.gpus for s in self.shares)

    @property
    def gpus_per_node(self) -> int:
        """The NVLink domain every pool's nodes are a multiple of (the planner's node)."""
        return math.gcd(*(s.pool.shape.node_size for s in self.shares))

    @property
    def global_batch(self) -> int:
        return sum(s.sequences for s in self.shares)

    def to_json(self) -> dict[str, Any]:
        return {**self.plan.to_json(), "pools": [s.to_json(self.global_batch) for s in self.shares],
                "balanced_step_s": round(self.balanced_step_s, 6),
                "even_step_s": round(self.even_step_s, 6)}


def parse_pools(text: str, gpus_per_node: int | None = None) -> list[Pool]:
    """`16xh100-80gb,16xa100-80gb` as pools, in the order given.

    Raises:
        ValueError: A malformed pool, a zero count, an unknown type, a type named
            twice, or a count that is not whole nodes; the message says what to write.
    """
    pools: list[Pool] = []
    for part in text.split(","):
        m = _POOL.match(part)
        if not m:
            raise ValueError(f"{part.strip()!r} is not a pool; write {POOL_SYNTAX}, "
                             "or a plain count with --gpu")
        count, name = int(m[1]), m[2].lower()
        if count < 1:
            raise ValueError(f"{part.strip()!r}: a pool needs at least one GPU; drop it or give a count "
                             "of 1 or more")
        if name not in CATALOG:
            raise ValueError(f"{part.strip()!r}: unknown GPU type {m[2]!r}; known: "
                             f"{', '.join(sorted(CATALOG))}")
        if any(p.acc.name == name for p in pools):
            raise ValueError(f"{name} is named twice; give each type once with its whole count "
                             f"(e.g. {sum(p.gpus for p in pools if p.acc.name == name) + count}x{name})")
        try:
            pools.append(Pool(get_accelerator(name), count, gpus_per_node))
        except ValueError as exc:
            raise ValueError(f"{part.strip()!r}: {exc}; give a whole number of nodes "
                             "(or set --gpus-per-node)") from None
    return pools


def single(p: Plan, pool: Pool, global_batch: int) -> PoolPlan:
    """A homogeneous plan on one pool, as a pool plan (balanced and even are the same)."""
    busy = p.time.get("compute", 0.0) + p.time.get("tp_comm", 0.0) + p.time.get("bubble", 0.0) \
        + p.time.get("pp_p2p", 0.0)
    share = PoolShare(pool, p.dp, global_batch, p.num_microbatches, p.memory_gb_per_gpu, busy)
    return PoolPlan(p, (share,), p.predicted_step_s, p.predicted_step_s)


def plan_single(model: ModelShape, pool: Pool, global_batch: int, **kw: Any) -> list[PoolPlan]:
    """`planner.plan` on one pool, fastest first."""
    return [single(p, pool, global_batch) for p in plan(model, pool.shape, pool.acc, global_batch, **kw)]


@dataclass(frozen=True)
class Candidate:
    """A ranked plan, built only when asked: a search over large pools finds thousands."""

    step_s: float
    memory_gb: float
    pools: int
    make: Callable[[], PoolPlan]

    def sort_key(self) -> tuple[int, float, int]:
        """Fastest first; ties (within TIE_S) to less memory, then fewer pools."""
        return round(self.step_s / TIE_S), self.memory_gb, self.pools

    @classmethod
    def of(cls, p: PoolPlan) -> Candidate:
        return cls(p.plan.predicted_step_s, p.plan.memory_gb_per_gpu, len(p.shares), lambda: p)


def plan_pools(model: ModelShape, pools: Sequence[Pool], global_batch: int, *, mix: bool = True,
               balance: str = "speed", top: int | None = None, zero_stages: Iterable[int] = (0, 1, 2, 3),
               schedules: Iterable[str] = SCHEDULES, memory_headroom: float = 0.9) -> list[PoolPlan]:
    """Plans on each pool alone and, with `mix`, on every mix of two or more pools
    (all of each pool's GPUs), fastest first.

    Args:
        model: The model's shape.
        pools: The GPU pools, one type each.
        global_batch: Sequences per optimizer step, the same for every candidate.
        mix: Whether replicas may spread over pools of different types.
        balance: "speed" (the worker splits the batch by speed) or "even"; which split
            a mix's `predicted_step_s`, and so its rank, is.
        top: At most this many plans.
        zero_stages, schedules, memory_headroom: As `planner.plan`.

    Returns:
        Plans that fit; empty when none does.
    """
    return [c.make() for c in search_pools(model, pools, global_batch, mix=mix, balance=balance,
                                           zero_stages=zero_stages, schedules=schedules,
                                           memory_headroom=memory_headroom)[:top]]


def search_pools(model: ModelShape, singles: Sequence[Pool], global_batch: int, *, mix: bool = True,
                 groups: Sequence[Sequence[Pool]] | None = None, balance: str = "speed",
                 **kw: Any) -> list[Candidate]:
    """`plan_pools`' ranking, each plan built when asked; `groups`: the mixes to try
    (default: with `mix`, every two or more of `singles`)."""
    from kuangchao.platform.planning.mix import search_mix  # mix builds on this module

    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {', '.join(BALANCES)}, got {balance!r}")
    if groups is None:
        groups = [g for n in range(2, len(singles) + 1) for g in combinations(singles, n)] if mix else []
    found = [Candidate.of(pp) for pool in singles for pp in plan_single(model, pool, global_batch, **kw)]
    for group in groups:
        found += search_mix(model, group, global_batch, balance=balance, **kw)
    return sorted(found, key=Candidate.sort_key)


def describe_pools(p: PoolPlan) -> str:
    """Where a plan runs, on one line: its pools and, for a mix, each type's share of
    the global batch and the balanced layout's step time beside the even split's."""
    where = " + ".join(s.pool.label for s in p.shares)
    if not p.mixed:
        return f"on {where}"
    gb = p.global_batch
    def count(s: PoolShare) -> str:  # micro-batches a replica: "x3", or "x2-3" when they differ
        low = s.sequences // p.plan.micro_batch // s.dp
        return f"x{low}" if low == s.micro_batches else f"x{low}-{s.micro_batches}"

    shares = ", ".join(f"{s.pool.acc.name} {s.sequences / gb:.0%} (dp={s.dp} {count(s)} micro-batches"
                       f" = {s.sequences} seq, {s.memory_gb_per_gpu:.1f} GB/GPU)" for s in p.shares)
    return (f"on {where}: balanced {p.balanced_step_s:.3g} s vs even {p.even_step_s:.3g} s; "
            f"batch {shares}")


def describe_plan(p: PoolPlan) -> str:
    """The planner's line for the layout, then where it runs."""
    return f"{describe(p.plan)}\n       {describe_pools(p)}"
