"""Auto-parallel planner: pick (dp, tp, pp, micro-batch, ZeRO, recompute, schedule)
from the model and the hardware instead of asking the user to hand-tune it.

Pure (stdlib only). The search lives here; the layouts' shapes in `shapes.py`
and the analytic cost model (memory and step time of one layout) in `cost.py`.
Ranks are laid out as the placement solver does, rank = (d * pp + s) * tp + t:
TP innermost (never across a node), then pipeline stages, then replicas. ZeRO 2
and 3 are also tried as HSDP, sharded within groups of consecutive replicas that
fill whole nodes or divide one (`shard_group_size`).

A MoE model (arch "moe") is also tried at every expert-parallel size that
divides both dp and its experts (an EP group: ep consecutive replicas), and
with sequence parallelism at tp > 1 where a layout would not fit without it
(`sequence_parallel=None`): SP costs about what TP's all-reduces did, so it is
taken where memory is the constraint. Dense models keep their plans: no EP,
and SP only when asked for (`sequence_parallel=True`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from kuangchao.platform.cluster.hardware import Accelerator
from kuangchao.platform.planning.cost import CostModel
from kuangchao.platform.planning.experts import expert_options
from kuangchao.platform.planning.shapes import ClusterShape, ModelShape, Plan

SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe")
# Plans whose predicted times differ by less than this are ties (less memory wins).
TIE_S = 1e-9


def _tp_options(model: ModelShape, cluster: ClusterShape) -> list[int]:
    out, t = [], 1
    while t <= cluster.node_size:
        if cluster.node_size % t == 0 and model.tp_divides(t):
            out.append(t)
        t *= 2
    return out


def _schedules(model: ModelShape, pp: int, schedules: Iterable[str]) -> list[tuple[str, int]]:
    if pp == 1:
        return [("none", 1)]
    out: list[tuple[str, int]] = []
    per_stage = model.n_layers // pp
    for sched in schedules:
        if sched == "interleaved_1f1b":  # each stage holds v chunks of per_stage / v layers
            out += [(sched, v) for v in range(2, per_stage + 1) if per_stage % v == 0]
        else:
            out.append((sched, 1))
    return out


def _check_args(global_batch: int, zero_stages: Iterable[int], schedules: Iterable[str],
                memory_headroom: float) -> None:
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    if not 0 < memory_headroom <= 1:
        raise ValueError(f"memory_headroom must be in (0, 1], got {memory_headroom}")
    if bad := sorted(set(zero_stages) - {0, 1, 2, 3}):
        raise ValueError(f"unknown ZeRO stage(s) {bad}; use 0-3")
    if bad_s := sorted(set(schedules) - set(SCHEDULES)):
        raise ValueError(f"unknown schedule(s) {bad_s}; use {', '.join(SCHEDULES)}")


def _hsdp_options(dp: int, tp: int, pp: int, node_size: int) -> list[int]:
    """Sharding-group sizes HSDP may use: powers of two from 2 below dp that fill whole
    nodes or divide one (placement keeps such a group of consecutive ranks together)."""
    out, g = [], 2
    while g < dp:
        span = g * tp * pp
        if dp % g == 0 and (span % node_size == 0 or node_size % span == 0):
            out.append(g)
        g *= 2
    return out


def _sp_ok(model: ModelShape, tp: int) -> bool:
    """Whether sequence parallelism can run at TP width `tp`: equal sequence shards."""
    return tp > 1 and model.seq_len % tp == 0


class _Contexts(dict):
    """One cost model per (expert-parallel size, sequence parallelism), made when first asked."""

    def __init__(self, model: ModelShape, cluster: ClusterShape, acc: Accelerator, global_batch: int):
        super().__init__()
        self.args = (model, cluster, acc, global_batch)

    def __missing__(self, key: tuple[int, bool]) -> CostModel:
        ctx = self[key] = CostModel(*self.args, ep=key[0], sp=key[1])
        return ctx


def _build(ctx: CostModel, dp: int, tp: int, pp: int, b: int, zero: int, rec: bool, sched: str, v: int,
           shard: int | None, budget: int) -> Plan:
    m = ctx.gb // (dp * b)
    memory = ctx.static_parts(dp, tp, pp, zero, shard)
    memory["grad_accumulation"] = ctx.accumulation(dp, tp, pp, zero, m, shard)
    memory["activations"] = ctx.act_bytes(tp, pp, b, m, rec, sched, v)
    total = sum(memory.values())
    compute, tp_comm, bubble, p2p, dp_comm, exposed, hier, moe = ctx.times(dp, tp, pp, b, m, zero,
                                                                           rec, sched, v, shard)
    step = compute + tp_comm + bubble + p2p + exposed + moe
    gpus = dp * tp * pp
    flops = ctx.m.flops_per_token(rec) * ctx.tokens
    model_flops = ctx.m.flops_per_token(False) * ctx.tokens
    time = {"compute": compute, "tp_comm": tp_comm, "bubble": bubble, "pp_p2p": p2p,
            "dp_comm": dp_comm, "dp_exposed": exposed}
    if ctx.m.is_moe:  # the all_to_alls, the routing counts' gathers, and the wait for the busiest experts
        time["ep_comm"], time["moe_routing"] = ctx.moe_comm(dp, tp, pp, b, m, rec)
        time["expert_wait"] = compute * (1 - ctx.m.flops_per_token(rec) / ctx.token_flops[rec])
    return Plan(dp, tp, pp, b, zero, rec, sched, total / 1e9, step, flops / step / gpus / 1e12,
                virtual_stages=v, num_microbatches=m, fits=total <= budget, hierarchical_allreduce=hier,
                memory_bytes=math.ceil(total), mfu=model_flops / step / gpus / ctx.acc.peak_flops,
                memory={k: x / 1e9 for k, x in memory.items()}, time=time, shard_group_size=shard,
                expert_parallel_size=ctx.ep, sequence_parallel=ctx.sp,
                expert_weights_gb=ctx.expert_weight_bytes(dp, tp, pp, zero, shard) / 1e9)


def plan(model: ModelShape, cluster: ClusterShape, acc: Accelerator, global_batch: int, *,
         zero_stages: Iterable[int] = (0, 1, 2, 3), schedules: Iterable[str] = SCHEDULES,
         top: int | None = None, memory_headroom: float = 0.9,
         sequence_parallel: bool | None = None, expert_parallel: int | None = None) -> list[Plan]:
    """Feasible plans, fastest first (ties: less memory).

    Args:
        model: The model's shape.
        cluster: GPUs to use (all of them: dp * tp * pp == cluster.gpus).
        acc: The accelerator's data sheet, or a calibrated copy.
        global_batch: Sequences per optimizer step; dp * micro_batch must divide it.
        zero_stages: ZeRO stages to consider; with dp == 1 all are stage 0.
        schedules: Pipeline schedules to consider when pp > 1.
        top: Return at most this many plans.
        memory_headroom: A plan fits when its memory is at most this share of HBM.
        sequence_parallel: True: every layout with tp > 1 that can (tp divides seq_len)
            uses it; False: none; None: a MoE model's where it would not fit without.
        expert_parallel: Only this expert-parallel size; None: every one the model and dp
            allow (a dense model: 1). Expert parallelism runs without ZeRO-1 and HSDP.

    Returns:
        Plans that fit; empty when none does.
    """
    zero_stages, schedules = sorted(set(zero_stages)), list(dict.fromkeys(schedules))
    _check_args(global_batch, zero_stages, schedules, memory_headroom)
    ctxs = _Contexts(model, cluster, acc, global_batch)
    budget = math.floor(memory_headroom * acc.hbm_bytes)  # whole bytes: ceil(memory) <= budget
    found: list[tuple[float, float, tuple[int, bool], tuple[int, int, int, int, int, bool, str, int,
                                                           int | None]]] = []
    for tp in _tp_options(model, cluster):
        sp_ok = _sp_ok(model, tp)
        # Whether the layouts at this tp use SP, and whether they fall back on it where
        # they do not fit without.
        sp_first = bool(sequence_parallel) and sp_ok
        sp_else = sequence_parallel is None and sp_ok and model.arch == "moe"
        for pp in (p for p in range(1, model.n_layers + 1) if model.n_layers % p == 0):
            if cluster.gpus % (tp * pp) or global_batch % (cluster.gpus // (tp * pp)):
                continue
            dp = cluster.gpus // (tp * pp)
            batches = [1 << i for i in range(global_batch.bit_length()) if global_batch % (dp << i) == 0]
            scheds = _schedules(model, pp, schedules)
            hsdp = [None, *_hsdp_options(dp, tp, pp, cluster.node_size)]
            for ep in expert_options(model, dp):
                if expert_parallel is not None and ep != expert_parallel:
                    continue
                variants = [ctxs[ep, sp_first]] + ([ctxs[ep, True]] if sp_else else [])
                for zero in ((0,) if dp == 1 else zero_stages):
                    if ep > 1 and zero == 1:
                        continue  # ZeroRedundancyOptimizer wants the same parameters on every rank
                    for shard in (hsdp if zero >= 2 and ep == 1 else [None]):
                        static = sum(variants[0].static_parts(dp, tp, pp, zero, shard).values())
                        if static > budget:  # no micro-batch can help; skip the layout early
                            continue
                        for rec in (False, True):
                            for sched, v in scheds:
                                for b in batches:  # activations grow with b: stop at the first miss
                                    m = global_batch // (dp * b)
                                    if sched == "interleaved_1f1b" and m % pp:
                                        continue  # Megatron: micro-batches must be a multiple of pp
                                    fit = _fitting(variants, static, budget, dp, tp, pp, b, m, zero, rec,
                                                   sched, v, shard)
                                    if fit is None:
                                        break
                                    ctx, mem = fit
                                    if mem > budget:  # FSDP2 accumulating unsharded gradients
                                        continue
                                    t = ctx.times(dp, tp, pp, b, m, zero, rec, sched, v, shard)
                                    step = t[0] + t[1] + t[2] + t[3] + t[5] + t[7]
                                    found.append((step, mem, (ep, ctx.sp),
                                                  (dp, tp, pp, b, zero, rec, sched, v, shard)))
    found.sort(key=lambda f: (round(f[0] / TIE_S), f[1]))
    return [_build(ctxs[variant], *key, budget=budget) for _, _, variant, key in found[:top]]


def _fitting(variants: list[CostModel], static: float, budget: int, dp: int, tp: int, pp: int, b: int,
             m: int, zero: int, rec: bool, sched: str, v: int, shard: int | None
             ) -> tuple[CostModel, float] | None:
    """The first variant whose activations fit beside `static`, and its memory with the
    gradients FSDP2 accumulates (which may still exceed the budget); None when none fits."""
    out = None
    for ctx in variants:
        act = ctx.act_bytes(tp, pp, b, m, rec, sched, v)
        if static + act > budget:
            continue
        out = ctx, static + act + ctx.accumulation(dp, tp, pp, zero, m, shard)
        if out[1] <= budget:
            return out
    return out


def evaluate(model: ModelShape, cluster: ClusterShape, acc: Accelerator, global_batch: int, *,
             tp: int, pp: int, micro_batch: int, zero_stage: int = 0, recompute: bool = False,
             schedule: str | None = None, virtual_stages: int = 1,
             shard_group_size: int | None = None, memory_headroom: float = 0.9,
             expert_parallel_size: int = 1, sequence_parallel: bool = False) -> Plan:
    """Score one given layout (e.g. a hand-written spec), fitting or not (see `Plan.fits`).

    `shard_group_size`: HSDP's sharding group (ZeRO 2 or 3); None, or the whole
    data-parallel size, is plain FSDP. `expert_parallel_size`: a MoE model's EP
    groups (consecutive replicas); `sequence_parallel`: SP in the TP group.

    Raises:
        ValueError: When the layout is not one `plan()` could produce.
    """
    schedule = schedule or ("none" if pp == 1 else "1f1b")
    _check_args(global_batch, [zero_stage], [] if pp == 1 else [schedule], memory_headroom)
    if tp not in _tp_options(model, cluster):
        raise ValueError(f"tp={tp} must be a power of two dividing the node ({cluster.node_size} GPUs), "
                         f"n_heads, the key/value heads, d_model and d_ff")
    if model.n_layers % pp or cluster.gpus % (tp * pp):
        raise ValueError(f"pp={pp} must divide n_layers ({model.n_layers}) and gpus / tp")
    dp = cluster.gpus // (tp * pp)
    if micro_batch < 1 or global_batch % (dp * micro_batch):
        raise ValueError(f"global_batch {global_batch} is not a multiple of dp * micro_batch "
                         f"= {dp * micro_batch}")
    if (schedule, virtual_stages) not in _schedules(model, pp, [schedule] if pp > 1 else []):
        raise ValueError(f"schedule {schedule!r} with virtual_stages={virtual_stages} is not valid "
                         f"for pp={pp} and {model.n_layers} layers")
    shard = shard_group_size if shard_group_size != dp else None
    if shard is not None and (zero_stage < 2 or shard < 2 or dp % shard):
        raise ValueError(f"shard_group_size={shard_group_size} needs zero_stage 2 or 3 and must be "
                         f"a divisor of dp ({dp}) of at least 2")
    if expert_parallel_size not in expert_options(model, dp):
        raise ValueError(f"expert_parallel_size={expert_parallel_size} must divide dp ({dp}) and "
                         f"the model's experts ({model.n_experts or 'none: a dense model'})")
    if expert_parallel_size > 1 and (zero_stage == 1 or shard is not None):
        raise ValueError("expert parallelism runs with zero_stage 0, 2 or 3 and without HSDP")
    if sequence_parallel and not _sp_ok(model, tp):
        raise ValueError(f"sequence_parallel needs tp > 1 dividing seq_len ({model.seq_len}), got tp={tp}")
    ctx = CostModel(model, cluster, acc, global_batch, ep=expert_parallel_size, sp=sequence_parallel)
    return _build(ctx, dp, tp, pp, micro_batch, zero_stage if dp > 1 else 0, recompute, schedule,
                  virtual_stages, shard, math.floor(memory_headroom * acc.hbm_bytes))


def describe(p: Plan) -> str:
    """One line, e.g. for `kc plan` output."""
    sched = p.schedule + (f" v={p.virtual_stages}" if p.schedule == "interleaved_1f1b" else "")
    return (f"dp={p.dp} tp={p.tp} pp={p.pp} ({sched}) micro_batch={p.micro_batch} x{p.num_microbatches} "
            f"zero={p.zero_stage}" + (f" hsdp={p.shard_group_size}" if p.shard_group_size else "")
            + (f" ep={p.expert_parallel_size}" if p.expert_parallel_size > 1 else "")
            + (" sp" if p.sequence_parallel else "")
            + f" recompute={'on' if p.recompute else 'off'}: "
            f"{p.memory_gb_per_gpu:.1f} GB/GPU, {p.predicted_step_s:.3g} s/step, "
            f"{p.predicted_tflops_per_gpu:.3g} TFLOP/s/GPU (MFU {p.mfu:.0%})"
            + (f", all-to-all {p.time.get('ep_comm', 0.0):.3g} s, experts "
               f"{p.expert_weights_gb:.2f} GB/GPU" if p.expert_parallel_size > 1 else "")
            + ("" if p.fits else " [does not fit]"))
