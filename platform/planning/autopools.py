"""`parallel: auto` for a job that accepts several GPU types (`resources.gpu_types`).

Pure: no Ray, no Redis. `autoplan.resolve` hands over when the spec lists two or
more types and no `parallel.gpu` (which prices every rank as one type, as before):

* Pools: per accepted type, the alive nodes of that type (`NodeInfo.gpu_type`)
  with the type's largest rank count (GPUs / `gpus_per_rank`); a smaller node of
  a type is left out, so each pool is whole nodes. Each pool is priced as its
  catalogue type, also on a local cluster whose typed nodes are CPU processes.
* Candidates: without `parallel.gpus`, each pool alone and, with
  `heterogeneous: true`, every mix of two or more pools (all of each pool's
  GPUs). With `parallel.gpus` N: each pool that has N ranks in whole nodes, and
  with `heterogeneous: true` every way to take N ranks as whole nodes from two
  or more pools. When the control plane knows no node of any accepted type, N
  ranks of the type with the least memory (a layout that fits it fits the rest).
* Global batch: `parallel.global_batch`, else micro_batch_size x
  gradient_accumulation_steps x the largest candidate's ranks (N, the sum of the
  pools when they may mix, else the largest pool), the same for every candidate so
  that their step times compare.
* Ranking: predicted step time, the balanced split's under `balance: speed`, the
  even split's under `balance: even`; ties to less memory, then fewer pools.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import combinations, islice

from kuangchao.platform.cluster.hardware import CATALOG
from kuangchao.platform.cluster.topology import ClusterTopology
from kuangchao.platform.errors import SpecError
from kuangchao.platform.planning.pools import Candidate, Pool, search_pools, speed
from kuangchao.platform.planning.shapes import ModelShape
from kuangchao.platform.spec.jobspec import JobSpec

# Mixes tried for a given `parallel.gpus` at most: ways to take whole nodes from the
# pools, those with the most of the fastest types first (the likely winners; each
# is a search of its own, and submission waits for them).
MAX_SPLITS = 16


def applies(spec: JobSpec) -> bool:
    """Whether `parallel: auto` plans across pools for this spec."""
    return len(spec.resources.gpu_types) >= 2 and spec.parallel.gpu is None


def pools_from_view(cluster: ClusterTopology | None, types: Sequence[str], gpus_per_rank: int) -> list[Pool]:
    """One pool per accepted type that has an alive node, in the order of `types`."""
    pools = []
    for t in types:
        nodes = [n for n in (cluster.nodes if cluster else ()) if n.alive and n.gpus > 0 and n.gpu_type == t]
        ranks = [n.gpus // gpus_per_rank if gpus_per_rank > 0 else n.gpus for n in nodes]
        per = max(ranks, default=0)
        if per >= 1:
            pools.append(Pool(CATALOG[t], per * ranks.count(per), per))
    return pools


def splits(pools: Sequence[Pool], n: int) -> Iterator[tuple[Pool, ...]]:
    """Ways to take `n` ranks as whole nodes from two or more of `pools` (in their
    order), the most of the fastest types first; at most MAX_SPLITS."""
    order = sorted(range(len(pools)), key=lambda i: -pools[i].speed)

    def walk(j: int, left: int, taken: dict[int, Pool]) -> Iterator[tuple[Pool, ...]]:
        if left == 0:
            if len(taken) >= 2:
                yield tuple(taken[i] for i in sorted(taken))
            return
        if j == len(order):
            return
        i = order[j]
        per = pools[i].shape.node_size
        for nodes in range(min(pools[i].gpus // per, left // per), -1, -1):
            more = {i: Pool(pools[i].acc, nodes * per, per)} if nodes else {}
            yield from walk(j + 1, left - nodes * per, {**taken, **more})

    return islice(walk(0, n, {}), MAX_SPLITS)


def _fits_count(pool: Pool, n: int) -> bool:
    per = pool.shape.node_size
    return n <= pool.gpus and (n <= per or n % per == 0)


def candidates(spec: JobSpec, cluster: ClusterTopology | None) -> tuple[list[Pool], list[tuple[Pool, ...]]]:
    """The single pools and the mixes to plan (see the module docstring).

    Raises:
        SpecError: On parallel.gpus, when there is nothing of the asked size to plan on.
    """
    types, n = spec.resources.gpu_types, spec.parallel.gpus
    pools = pools_from_view(cluster, types, spec.parallel.gpus_per_rank)
    names = " or ".join(types)
    if not pools:
        if n is None:
            raise SpecError([("parallel.gpus", f"the control plane knows no alive node of type {names} "
                              "yet, so it cannot count the pools; give parallel.gpus")])
        acc = min((CATALOG[t] for t in types), key=lambda a: (a.hbm_bytes, speed(a)))
        try:
            return [Pool(acc, n)], []
        except ValueError as exc:
            raise SpecError([("parallel.gpus", str(exc))]) from None
    mix = spec.resources.heterogeneous
    if n is None:
        groups = [g for k in range(2, len(pools) + 1) for g in combinations(pools, k)] if mix else []
        return pools, groups
    singles = [Pool(p.acc, n, p.gpus_per_node) for p in pools if _fits_count(p, n)]
    groups = list(splits(pools, n)) if mix else []
    if not singles and not groups:
        have = ", ".join(f"{p.label} ({p.shape.node_size} a node)" for p in pools)
        how = "whole nodes of one type or of several" if mix else "whole nodes of one type"
        raise SpecError([("parallel.gpus", f"{n} ranks cannot be taken as {how} from the pools the "
                          f"cluster has ({have}); give a count they hold"
                          + ("" if mix else ", or set resources.heterogeneous: true to mix types"))])
    return singles, groups


def global_batch(spec: JobSpec, singles: Sequence[Pool], groups: Sequence[tuple[Pool, ...]]) -> int:
    p = spec.parallel
    largest = max([s.gpus for s in singles] + [sum(x.gpus for x in g) for g in groups])
    return p.global_batch or p.micro_batch_size * p.gradient_accumulation_steps * largest


def ranked(spec: JobSpec, model: ModelShape,
           cluster: ClusterTopology | None) -> tuple[list[Candidate], int, str]:
    """Every fitting candidate plan, fastest first (each built when asked); the global
    batch; what was planned on, in words (for the message when nothing fits)."""
    singles, groups = candidates(spec, cluster)
    gb = global_batch(spec, singles, groups)
    try:
        found = search_pools(model, singles, gb, groups=groups, balance=spec.resources.balance)
    except ValueError as exc:
        raise SpecError([("parallel.global_batch", str(exc))]) from None
    on = ", ".join(p.label for p in singles)
    if groups:
        on += (", " if on else "") + "mixes of " + ", ".join(
            dict.fromkeys(" + ".join(p.acc.name for p in g) for g in groups))
    return found, gb, on
