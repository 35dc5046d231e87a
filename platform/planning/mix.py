"""A mix of GPU pools: data-parallel replicas of one layout on several GPU types.

Pure (stdlib only). Each replica's tp x pp ranks are of one type (a TP group never
mixes types; its pipeline stays on that type too), so a pool of `n` GPUs holds
n / (tp x pp) replicas and every pool must divide evenly. Every replica runs the
same layout; what differs is how much of the global batch it gets:

* balanced (`balance: speed`): each replica gets micro-batches in proportion to its
  type's speed (`pools.speed`: peak x mfu_ceiling), at least one each, handed out
  one at a time to the replica that would finish it first (optimal for identical
  micro-batches on GPUs of different speeds). The worker weighs gradients by
  sample count, so the update equals a homogeneous global batch's.
* even: every replica gets global_batch / (dp x micro_batch) micro-batches, as a
  homogeneous job; the slowest type sets the pace.

Predicted step time = the slowest type's replica time for its share (compute, TP,
pipeline bubble and sends, priced on that type) + the exposed data-parallel sync
over the whole group. Memory: each type's ranks must fit that type's memory with
the micro-batches it gets (ZeRO shards are even over the group, so the smallest
memory bounds them); a layout that does not fit every type is not offered.

Not priced: a pipeline whose stages are on different types (layers split by speed,
Whale's stage balancing). Mixes here are data-parallel across pools.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from kuangchao.platform.cluster.hardware import Accelerator
from kuangchao.platform.planning.cost import CostModel
from kuangchao.platform.planning.planner import (
    SCHEDULES,
    _check_args,
    _schedules,
    _tp_options,
)
from kuangchao.platform.planning.pools import Candidate, Pool, PoolPlan, PoolShare
from kuangchao.platform.planning.shapes import ClusterShape, ModelShape, Plan

Key = tuple[int, int, int, int, bool, str, int, int | None]  # tp, pp, b, zero, rec, sched, v, shard


def slowest_links(accs: Sequence[Accelerator]) -> Accelerator:
    """One accelerator with the slowest links (and latencies) of all of `accs`.

    Conservative on purpose: the data-parallel ring of a mix visits every type's
    nodes, and a ring moves at its slowest hop, so its collectives are priced as
    if every hop were the slowest type's (the faster type's NVLink is not credited)."""
    if len(set(accs)) == 1:
        return accs[0]
    return replace(min(accs, key=lambda a: (a.internode_bytes_per_s, a.nvlink_bytes_per_s)),
                   nvlink_bytes_per_s=min(a.nvlink_bytes_per_s for a in accs),
                   internode_bytes_per_s=min(a.internode_bytes_per_s for a in accs),
                   nic_bytes_per_s=min(a.nic_alone_bytes_per_s for a in accs),
                   base_latency_s=max(a.base_latency_s for a in accs),
                   hop_latency_s=max(a.hop_latency_s for a in accs),
                   net_hop_latency_s=max(a.net_hop_latency_s for a in accs),
                   rings_aggregate_nics=all(a.rings_aggregate_nics for a in accs))


def apportion(units: int, dps: Sequence[int], speeds: Sequence[float]) -> tuple[int, ...]:
    """Units of work per type (over all its replicas): one per replica, then each next
    unit to the replica that would finish it first (ties: the faster type)."""
    counts = list(dps)
    if units < sum(dps):
        raise ValueError(f"{units} micro-batches cannot give each of {sum(dps)} replicas one")
    heap = [((counts[k] // dps[k] + 1) / speeds[k], -speeds[k], k) for k in range(len(dps))]
    heapq.heapify(heap)
    for _ in range(units - sum(dps)):
        _, neg, k = heapq.heappop(heap)
        counts[k] += 1
        heapq.heappush(heap, ((counts[k] // dps[k] + 1) / speeds[k], neg, k))
    return tuple(counts)


def _hsdp(dps: Sequence[int], tp: int, pp: int, node_sizes: Sequence[int]) -> list[int]:
    """HSDP sharding groups that stay inside one type: powers of two dividing every
    pool's replicas and filling whole nodes of it (or dividing one)."""
    out, g = [], 2
    while g < sum(dps):
        span = g * tp * pp
        if all(d % g == 0 for d in dps) and all(span % n == 0 or n % span == 0 for n in node_sizes):
            out.append(g)
        g *= 2
    return out


class _Mix:
    """Per-search constants: each type's cost model and budget, and the whole group's links."""

    def __init__(self, model: ModelShape, pools: Sequence[Pool], global_batch: int, headroom: float):
        self.model, self.pools, self.gb = model, tuple(pools), global_batch
        self.ctxs = [CostModel(model, p.shape, p.acc, global_batch) for p in pools]
        self.budgets = [math.floor(headroom * p.acc.hbm_bytes) for p in pools]
        self.speeds = [p.speed for p in pools]
        node = math.gcd(*(p.shape.node_size for p in pools))
        # Pools of different types are different nodes: the group's node is one NVLink
        # domain every pool's nodes are a multiple of.
        self.links = CostModel(model, ClusterShape(sum(p.gpus for p in pools), node),
                               slowest_links([p.acc for p in pools]), global_batch)
        self._split: dict[tuple[int, int, tuple[int, ...]], tuple[int, ...]] = {}

    def per_replica(self, dps: tuple[int, ...], m: int, unit: int, balanced: bool) -> tuple[int, ...]:
        """Micro-batches a replica of each type gets (the most any of its replicas gets);
        `unit`: they come in groups of this many (interleaved 1F1B: pp)."""
        if not balanced:
            return tuple(m for _ in dps)
        key = (m, unit, dps)
        if key not in self._split:
            self._split[key] = apportion(sum(dps) * m // unit, dps, self.speeds)
        return tuple(-(-c // d) * unit for c, d in zip(self._split[key], dps, strict=True))

    def memory(self, k: int, dp: int, key: Key, m: int) -> dict[str, float]:
        tp, pp, b, zero, rec, sched, v, shard = key
        ctx = self.ctxs[k]
        out = ctx.static_parts(dp, tp, pp, zero, shard)
        out["grad_accumulation"] = ctx.accumulation(dp, tp, pp, zero, m, shard)
        out["activations"] = ctx.act_bytes(tp, pp, b, m, rec, sched, v)
        return out

    def varying(self, k: int, dp: int, key: Key, m: int) -> float:
        """Bytes of type k's ranks that depend on their micro-batches (beyond `static_parts`)."""
        tp, pp, b, zero, rec, sched, v, shard = key
        ctx = self.ctxs[k]
        return ctx.act_bytes(tp, pp, b, m, rec, sched, v) + ctx.accumulation(dp, tp, pp, zero, m, shard)

    def price(self, dp: int, key: Key, ms: Sequence[int]) -> tuple[float, int, list[tuple[float, ...]],
                                                                    tuple[float, float, bool]]:
        """(step seconds, the critical type, each type's (compute, tp, bubble, p2p), the sync)."""
        tp, pp, b, zero, rec, sched, v, shard = key
        parts = []
        for ctx, m in zip(self.ctxs, ms, strict=True):
            compute = ctx.replica_compute(tp, pp, b, m, rec)
            parts.append((compute, *ctx.stage_times(compute, dp, tp, pp, b, m, zero, rec, sched, v)))
        crit = max(range(len(parts)), key=lambda k: sum(parts[k]))
        sync = self.links.dp_sync(dp, tp, pp, ms[crit], zero, rec, parts[crit][0] + parts[crit][1], shard)
        return sum(parts[crit]) + sync[1], crit, parts, sync

    def build(self, key: Key, dps: tuple[int, ...], balance: str) -> PoolPlan:
        tp, pp, b, zero, rec, sched, v, shard = key
        dp = sum(dps)
        m = self.gb // (dp * b)
        unit = pp if sched == "interleaved_1f1b" else 1
        bal, even = self.per_replica(dps, m, unit, True), self.per_replica(dps, m, unit, False)
        chosen = bal if balance == "speed" else even
        priced = {ms: self.price(dp, key, ms) for ms in (bal, even)}
        step, crit, parts, (dp_comm, exposed, hier) = priced[chosen]
        mems = [self.memory(k, dp, key, chosen[k]) for k in range(len(dps))]
        top = max(range(len(dps)), key=lambda k: sum(mems[k].values()))
        gpus = dp * tp * pp
        peak = sum(p.gpus * p.acc.peak_flops for p in self.pools)
        flops = self.model.flops_per_token(rec) * self.gb * self.model.seq_len
        model_flops = self.model.flops_per_token(False) * self.gb * self.model.seq_len
        c = parts[crit]
        time = {"compute": c[0], "tp_comm": c[1], "bubble": c[2], "pp_p2p": c[3],
                "dp_comm": dp_comm, "dp_exposed": exposed}
        total = sum(mems[top].values())
        plan = Plan(dp, tp, pp, b, zero, rec, sched, total / 1e9, step, flops / step / gpus / 1e12,
                    virtual_stages=v, num_microbatches=m, hierarchical_allreduce=hier,
                    memory_bytes=math.ceil(total), mfu=model_flops / step / peak,
                    memory={n: x / 1e9 for n, x in mems[top].items()}, time=time, shard_group_size=shard)
        units = self._split[(m, unit, dps)] if balance == "speed" else tuple(d * m // unit for d in dps)
        shares = tuple(PoolShare(pool, d, u * unit * b, most, sum(mem.values()) / 1e9, sum(pt))
                       for pool, d, u, most, mem, pt in zip(self.pools, dps, units, chosen, mems, parts,
                                                            strict=True))
        return PoolPlan(plan, shares, priced[bal][0], priced[even][0])


def plan_mix(model: ModelShape, pools: Sequence[Pool], global_batch: int, *, top: int | None = None,
             **kw: Any) -> list[PoolPlan]:
    """Layouts whose replicas spread over all of `pools` (two or more), fastest first;
    the arguments are `search_mix`'s."""
    return [c.make() for c in search_mix(model, pools, global_batch, **kw)[:top]]


def search_mix(model: ModelShape, pools: Sequence[Pool], global_batch: int, *, balance: str = "speed",
               zero_stages: Iterable[int] = (0, 1, 2, 3), schedules: Iterable[str] = SCHEDULES,
               memory_headroom: float = 0.9) -> list[Candidate]:
    """Every layout whose replicas spread over all of `pools` (two or more) and fit each
    type, fastest first, each built only when asked (`Candidate.make`).

    `balance`: "speed" ranks by the balanced split's step time, "even" by the even
    split's. The other arguments are `planner.plan`'s.
    """
    if len(pools) < 2:
        raise ValueError("a mix needs two or more pools; plan one pool with planner.plan")
    zero_stages, schedules = sorted(set(zero_stages)), list(dict.fromkeys(schedules))
    _check_args(global_batch, zero_stages, schedules, memory_headroom)
    mx = _Mix(model, pools, global_batch, memory_headroom)
    tps = [t for t in _tp_options(model, pools[0].shape)
           if all(t in _tp_options(model, p.shape) for p in pools[1:])]
    found: list[Candidate] = []
    for tp in tps:
        for pp in (p for p in range(1, model.n_layers + 1) if model.n_layers % p == 0):
            if any(p.gpus % (tp * pp) for p in pools):
                continue
            dps = tuple(p.gpus // (tp * pp) for p in pools)
            dp = sum(dps)
            batches = [1 << i for i in range(global_batch.bit_length()) if global_batch % (dp << i) == 0]
            hsdp = [None, *_hsdp(dps, tp, pp, [p.shape.node_size for p in pools])]
            for zero in zero_stages:
                for shard in (hsdp if zero >= 2 else [None]):
                    statics = [sum(c.static_parts(dp, tp, pp, zero, shard).values()) for c in mx.ctxs]
                    if any(x > budget for x, budget in zip(statics, mx.budgets, strict=True)):
                        continue  # no micro-batch can help
                    for rec in (False, True):
                        for sched, v in _schedules(model, pp, schedules):
                            for b in batches:
                                m = global_batch // (dp * b)
                                if sched == "interleaved_1f1b" and m % pp:
                                    continue  # Megatron: micro-batches a multiple of pp
                                key: Key = (tp, pp, b, zero, rec, sched, v, shard)
                                bal = mx.per_replica(dps, m, pp if sched == "interleaved_1f1b" else 1, True)
                                split = bal if balance == "speed" else (m,) * len(dps)
                                varying = [{n: mx.varying(k, dp, key, n) for n in {bal[k], m}}
                                           for k in range(len(dps))]
                                if any(statics[k] + max(varying[k].values()) > mx.budgets[k]
                                       for k in range(len(dps))):
                                    continue  # both splits must fit every type
                                memory = max(statics[k] + varying[k][split[k]] for k in range(len(dps)))
                                found.append(Candidate(mx.price(dp, key, split)[0], memory / 1e9, len(dps),
                                                       partial(mx.build, key, dps, balance)))
    return sorted(found, key=Candidate.sort_key)
