"""Elastic jobs: which data-parallel sizes a job may run at, and what each size means.

A replica is one pipeline: `tp * pp` ranks, holding ranks
`[i * tp * pp, (i + 1) * tp * pp)`. A job runs at any *admissible* replica
count between `elastic.min_replicas` and `elastic.max_replicas`.

The global batch (samples per optimizer step) never changes: it is fixed by
the spec as written, `micro_batch_size * gradient_accumulation_steps *
data_parallel_size`. At `n` replicas each replica accumulates
`global_batch / (micro_batch_size * n)` micro-batches, so `n` is admissible
only when that divides evenly. Together with the index-based sample order
(`kuangchao.workers.data.sampling.batch_indices`) this keeps each step's set of
samples the same at every size.

Pure: no Ray, no Redis. The scheduler, the controller and the workers all
ask this module.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kuangchao.platform.spec.defaults import value


@dataclass(frozen=True)
class ElasticRange:
    """The sizes a job may run at. A job without `elastic:` has `min == max`."""

    min_replicas: int
    max_replicas: int
    micro_batch_size: int
    global_batch: int
    ranks_per_replica: int = 1
    gpus_per_rank: int = 1
    # HSDP's sharding group (`parallel.shard_group_size`), or the expert-parallel size:
    # the replica count stays a multiple of it, so the data-parallel ranks split into
    # whole groups at every size.
    replica_multiple: int = 1

    @property
    def elastic(self) -> bool:
        return self.max_replicas > self.min_replicas

    @property
    def gpus_per_replica(self) -> int:
        return self.ranks_per_replica * self.gpus_per_rank

    def admissible(self, n: int) -> bool:
        return (self.min_replicas <= n <= self.max_replicas and n % self.replica_multiple == 0
                and self.global_batch % (self.micro_batch_size * n) == 0)

    def sizes(self, upto: int | None = None) -> list[int]:
        """Admissible replica counts, largest first, none above `upto`."""
        top = self.max_replicas if upto is None else min(upto, self.max_replicas)
        return [n for n in range(top, self.min_replicas - 1, -1) if self.admissible(n)]

    def accumulation(self, n: int) -> int:
        """Micro-batches each replica accumulates per optimizer step at `n` replicas."""
        if not self.admissible(n):
            raise ValueError(f"{n} replicas is not an admissible size; choose one of {self.sizes()}")
        return self.global_batch // (self.micro_batch_size * n)

    def target(self, desired: int | None) -> int:
        """The size to aim for: the user's `kc scale` request, else the maximum."""
        if desired is not None and self.admissible(desired):
            return desired
        return self.max_replicas

    def world_size(self, n: int) -> int:
        return n * self.ranks_per_replica

    def replica_ranks(self, replica: int) -> range:
        k = self.ranks_per_replica
        return range(replica * k, (replica + 1) * k)


def elastic_range(spec_doc: dict[str, Any]) -> ElasticRange:
    """The range of a raw spec document; a typed spec has `JobSpec.elastic_range`."""
    return range_from(functools.partial(value, spec_doc, "parallel"),
                      functools.partial(value, spec_doc, "elastic"))


def range_from(par: Callable[[str], Any], el: Callable[[str], Any]) -> ElasticRange:
    """The range from two field readers, one for `parallel`, one for `elastic`."""
    dp = int(par("data_parallel_size"))
    micro = int(par("micro_batch_size"))
    accum = int(par("gradient_accumulation_steps"))
    lo, hi = el("min_replicas"), el("max_replicas")
    lo = int(lo) if lo is not None else (dp if hi is None else 1)
    hi = int(hi) if hi is not None else max(dp, lo)
    group = par("shard_group_size")
    group = int(group) if group and int(par("zero_stage")) >= 2 else 1
    return ElasticRange(
        min_replicas=lo, max_replicas=hi, micro_batch_size=micro, global_batch=micro * accum * dp,
        ranks_per_replica=int(par("tensor_parallel_size")) * int(par("pipeline_parallel_size")),
        gpus_per_rank=int(par("gpus_per_rank")),
        replica_multiple=math.lcm(group, int(par("expert_parallel_size"))))


def range_errors(spec_doc: dict[str, Any]) -> list[tuple[str, str]]:
    """Problems with a spec's elastic range, each naming the field to change."""
    el = spec_doc.get("elastic") or {}
    if el.get("min_replicas") is None and el.get("max_replicas") is None:
        return []
    r = elastic_range(spec_doc)
    if r.min_replicas > r.max_replicas:
        return [("elastic.min_replicas",
                 f"{r.min_replicas} exceeds elastic.max_replicas ({r.max_replicas})")]
    errs = []
    ep = int(value(spec_doc, "parallel", "expert_parallel_size"))
    for field, n in (("min_replicas", r.min_replicas), ("max_replicas", r.max_replicas)):
        if n % r.replica_multiple:
            groups = ("HSDP sharding groups of parallel.shard_group_size" if ep == 1 else
                      "groups of expert-parallel ranks (and HSDP sharding groups)")
            errs.append((f"elastic.{field}", (
                f"{n} replicas do not split into whole {groups} ({r.replica_multiple}); use "
                "a multiple of it")))
        elif not r.admissible(n):
            errs.append((f"elastic.{field}", (
                f"the global batch of {r.global_batch} samples (micro_batch_size x "
                f"gradient_accumulation_steps x data_parallel_size) does not split evenly into "
                f"{n} replica(s) of micro-batches of {r.micro_batch_size}; pick a range whose "
                f"sizes divide {r.global_batch // r.micro_batch_size}, or raise "
                "parallel.gradient_accumulation_steps")))
    return errs


def samples_seen(steps: int, global_batch: int) -> int:
    """Samples trained on after `steps` optimizer steps: every step takes one global batch."""
    return max(0, steps) * global_batch


@dataclass(frozen=True)
class Membership:
    """Who is in the next generation of a job's process group.

    `ranks` maps each current rank that stays to its new rank; ranks not in
    it leave. `joining` new ranks are started fresh and receive the state.
    """

    ranks: dict[int, int]
    joining: tuple[int, ...]
    world_size: int


def plan_membership(world_size: int, rng: ElasticRange, to_replicas: int,
                    drop_ranks: frozenset[int] | set[int] = frozenset()) -> Membership:
    """The next generation at `to_replicas` replicas.

    Every replica holding a rank in `drop_ranks` leaves, then the
    highest-numbered replicas down to `to_replicas`; survivors keep their
    order and are renumbered from 0, and fresh ranks fill up to `to_replicas`
    (a grow, or a dead replica replaced). A replica is one unit: a dead rank
    takes its tensor- and pipeline-parallel peers with it.

    Raises:
        ValueError: When `to_replicas` is not an admissible size.
    """
    if not rng.admissible(to_replicas):
        raise ValueError(f"{to_replicas} replicas is not an admissible size; "
                         f"choose one of {rng.sizes()}")
    n = world_size // rng.ranks_per_replica
    keep = [i for i in range(n) if not any(r in drop_ranks for r in rng.replica_ranks(i))]
    keep = keep[:to_replicas]
    old = [r for i in keep for r in rng.replica_ranks(i)]
    new_world = rng.world_size(to_replicas)
    return Membership(ranks={r: new for new, r in enumerate(old)},
                      joining=tuple(range(len(old), new_world)), world_size=new_world)


def replicas_left(world_size: int, rng: ElasticRange, drop_ranks: set[int]) -> int:
    """Whole replicas that hold none of `drop_ranks`."""
    n = world_size // rng.ranks_per_replica
    return sum(1 for i in range(n) if not any(r in drop_ranks for r in rng.replica_ranks(i)))
