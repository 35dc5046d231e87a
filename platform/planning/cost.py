"""The planner's analytic cost model: the memory and step time of one layout, as the
engine (workers/parallel/engine.py) runs it with bf16 mixed precision.

An analytic model, not a simulator: it ranks layouts and rejects ones that
cannot fit. Each collective's seconds come from `comm.py` (NCCL's ring and tree:
latency per step, bus bandwidth, the node's NICs shared by its GPUs).
docs/parallelism.md states the same, with the measurements it is held against
(tests/unit/test_planner_calibration.py).

Memory per GPU (bytes), `P = params / (tp * pp)` (embeddings spread evenly). The
parameters are fp32 (autocast, or FSDP2's sharded master copy), gradients fp32,
Adam's two moments fp32: 4P + 4P + 8P. ZeRO-1 (ZeroRedundancyOptimizer) shards
the moments over dp; ZeRO-2/3 (FSDP2) shard all three over the sharding group
(dp, or `shard_group_size` under HSDP) and add bf16 working copies: every layer
of the stage for ZeRO-2 (gathered from forward to backward) and for ZeRO-3 under
a pipeline (not resharded after backward until the last micro-batch), the layer
in use and the prefetched one for ZeRO-3 otherwise. With gradient accumulation FSDP2 keeps the
unsharded fp32 gradients between micro-batches (`set_requires_gradient_sync`).
Activations per layer per micro-batch (Korthikanti et al. 2022, Eq. 2 with d_ff in
place of 4h): s*b*(10h + (8h + c*f)/t), c = 4 for GELU, 6 for SwiGLU; Eq. 2's
5*a*s^2*b/t for the attention scores is left out, since the engine's attention is
`scaled_dot_product_attention`, whose fused kernels keep no s x s scores; with
full recompute each layer's input (2sbh) plus one layer being recomputed.
The first stage keeps min(pp, m) micro-batches in flight under 1F1B, times
(1 + (pp-1)/(v*pp)) interleaved, m under GPipe; plus fp32 logits 4*s*b*V/t and
the accelerator's reserved bytes.

Step time = compute + TP all-reduces + bubble + stage sends + exposed DP traffic:
  compute: training FLOPs / (gpus * peak * efficiency); FLOPs per token = passes *
    (2 * matmul params + 4*s*h*L attention) + 6*h*V logits, passes 3, or 4 with
    recompute (Narayanan et al. 2021, Sec. 5.1).
  TP: 4 all-reduces of s*b*h bf16 values per layer per micro-batch (6 with
    recompute) over NVLink, on the compute stream (Shoeybi et al. 2019).
  Bubble: (pp-1)/m of the busy time, (pp-1)/(v*m) interleaved (Narayanan Sec. 2.2).
  Sends: 2(v*m + pp - 1) of s*b*h activations per rank (fp32 residual stream under
    autocast, bf16 under FSDP2); every TP rank sends its own copy.
  DP, by what the engine issues:
    ZeRO-0/1, tp = pp = 1: DDP's 25 MiB bucket all-reduces of the fp32 gradients
      during the last micro-batch's backward. They run beside it from the first
      bucket on; what outlasts the backward is exposed, and never less than the
      last bucket (the embedding's gradient, ready only at the end). Where the
      engine's `auto` picks the two-level hook (`allreduce_costs`), its
      collectives are synchronous on the backward stream: all exposed.
    ZeRO-0/1 with tp or pp > 1: one flat all-reduce after backward, exposed.
    ZeRO-1 also broadcasts every parameter tensor from its owner after the step
      (ZeroRedundancyOptimizer._sync_params), exposed.
    ZeRO-2/3 (FSDP2, `fully_shard` per block): per layer a bf16 all-gather before
      its forward (ZeRO-3: again before its backward) and an fp32 reduce-scatter
      after its backward on the last micro-batch; HSDP adds an all-reduce of the
      shard across the groups. FSDP2 prefetches one layer ahead on its own
      streams: a layer's all-gather runs during the previous layer's compute, and
      in backward the next all-gather and the last reduce-scatter share the wire
      during a layer's backward. Each layer exposes what its collectives take
      beyond its compute, plus the first all-gather and the last reduce-scatter
      of each pass. Under a pipeline the reduce-scatters wait for the end of the
      step (torch.distributed.pipelining's REDUCE_GRAD): exposed.
  Hidden traffic still costs CONTENTION of its own time (NCCL's kernels take SMs
  and memory bandwidth from the compute they run beside).

Mixture of experts (`experts.py` says how): the experts' parameters split over
the EP group, each block's MLP activations become its top_k experts', the expert
FLOPs wait for the busiest rank (`imbalance`) and each block adds its exposed
all_to_alls and routing-count all-gather (`moe_comm`). The data-parallel traffic
is costed on the rank's own parameters over all dp ranks, although the experts'
sync over dp / ep of them: a ring's (n-1)/n barely tells the two apart. Sequence parallelism (`sp`) divides
the TP-replicated activations (and a recomputed layer's stored input) by tp,
Korthikanti's s*b*h*34/t; its all-gathers and reduce-scatters move what TP's
all-reduces did, so TP's time stays as it is.
"""

from __future__ import annotations

from typing import Any

from kuangchao.platform.cluster.hardware import Accelerator
from kuangchao.platform.planning import experts
from kuangchao.platform.planning.activations import REPLICATED_UNDER_TP
from kuangchao.platform.planning.comm import (
    DDP_BUCKET_BYTES,
    allreduce_costs,
    bus_bandwidth,
    collective,
    latency,
    p2p,
)
from kuangchao.platform.planning.shapes import ClusterShape, ModelShape

# Communication hidden behind compute slows that compute by this share of its own time.
CONTENTION = 0.1
# Heuristic: a GEMM dimension of x elements runs at x / (x + GEMM_KNEE) of the
# large-GEMM rate (tiles and waves underfill the SMs on thin matrices). This is
# what makes TP on a 768-wide model, or tiny micro-batches, cost something.
GEMM_KNEE = 64
# Bytes per value: fp32 parameters, gradients and Adam moments; bf16 activations and
# FSDP2 all-gathers; fp32 FSDP2 reductions (MixedPrecisionPolicy reduce_dtype).
FP32, BF16 = 4, 2


def bubble_fraction(schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Idle time over busy time: (pp-1)/m, or (pp-1)/(v*m) interleaved (Narayanan et al. 2021)."""
    if pp <= 1 or schedule == "none":
        return 0.0
    v = virtual_stages if schedule == "interleaved_1f1b" else 1
    return (pp - 1) / (v * num_microbatches)


def _gemm(x: float) -> float:
    return x / (x + GEMM_KNEE)


class CostModel:
    """Per-search constants, so the inner loop does arithmetic only; one per expert-parallel
    size `ep` and sequence-parallel choice `sp` (a dense model: ep 1)."""

    def __init__(self, model: ModelShape, cluster: ClusterShape, acc: Accelerator, global_batch: int,
                 ep: int = 1, sp: bool = False):
        self.m, self.c, self.acc, self.gb = model, cluster, acc, global_batch
        self.ep, self.sp = ep, sp
        s, h = model.seq_len, model.d_model
        self.params = model.params
        self.layer_params = model.layer_params
        self.other_params = model.params - model.n_layers * model.layer_params  # embeddings, head, norm
        self.expert_params = 0.0  # within `params`: the experts this rank's EP slot holds
        swiglu = model.swiglu
        # Parameter tensors (one ZeRO-1 broadcast each): per block, and outside the blocks.
        self.layer_tensors, self.other_tensors = (9, 3) if swiglu else (16, 4)
        mlp_coef = 6 if swiglu else 4
        # Korthikanti Eq. 2 for b = 1, split into TP-replicated and TP-sharded parts
        # (activations.py's terms, with d_ff and SwiGLU in the sharded part).
        self.act_rep = s * REPLICATED_UNDER_TP * h
        self.act_shard = s * (8 * h + mlp_coef * model.ffn)
        self.logits = 4 * s * model.vocab_size
        self.tokens = global_batch * s
        self.token_flops = {rec: model.flops_per_token(rec) for rec in (False, True)}
        if model.is_moe:
            self._experts()
        self.step_flops = {rec: self.token_flops[rec] * self.tokens for rec in (False, True)}
        self._memo: dict[tuple, Any] = {}

    def _experts(self) -> None:
        """A MoE model's sizes on one rank of an EP group of `ep` (experts.py)."""
        m, ep, s = self.m, self.ep, self.m.seq_len
        held = m.layer_expert_params / ep  # one block's experts on this rank (before tp)
        self.expert_params = m.n_layers * held
        self.layer_params = m.layer_params - m.layer_expert_params + held
        self.params = self.other_params + m.n_layers * self.layer_params
        # The router, and gate, up and down per expert held, in place of one MLP's three.
        self.layer_tensors += 1 + 3 * (m.n_experts or 1) // ep - 3
        imb = experts.imbalance(m.capacity_factor, ep)
        rep, shard = experts.activation_terms(m, imb)
        self.act_rep, self.act_shard = s * rep, s * shard
        self.token_flops = {rec: m.flops_per_token(rec) + (imb - 1) * m.expert_flops_per_token(rec)
                            for rec in (False, True)}

    def _coll(self, kind: str, nbytes: float, ranks: int, per_node: int) -> float:
        """`comm.collective`, memoised: the search asks the same ones many times."""
        key = (kind, nbytes, ranks, per_node)
        t = self._memo.get(key)
        if t is None:
            t = self._memo[key] = collective(kind, nbytes, ranks, per_node, self.acc)
        return t

    def _memoised(self, key: tuple, fn: Any, *args: Any) -> Any:
        if key not in self._memo:
            self._memo[key] = fn(*args)
        return self._memo[key]

    # -- memory ------------------------------------------------------------------

    def static_parts(self, dp: int, tp: int, pp: int, zero: int,
                     shard: int | None = None) -> dict[str, float]:
        """Bytes that do not depend on the micro-batch (see `accumulation` for the rest)."""
        p = self.params / (tp * pp)
        pe = self.expert_params / (tp * pp)  # the experts' share of p
        fsdp = zero >= 2 and dp > 1
        g = (shard or dp) if fsdp else 1
        # The experts' optimizer states shard over the dp / ep replicas that hold them.
        opt = g if fsdp else dp if zero == 1 else 1
        ge, opt_e = max(1, g // self.ep), max(1, opt // self.ep)
        working = 0.0  # FSDP2's bf16 copies gathered for compute
        if fsdp:
            layer = BF16 * self.layer_params / tp
            root = BF16 * self.other_params / (tp * pp)  # the root module stays gathered
            # ZeRO-3 holds the block in use and the prefetched one; ZeRO-2, and ZeRO-3 under a
            # pipeline (no resharding after backward until the last micro-batch), the stage.
            working = root + (2 * layer if zero >= 3 and pp == 1 else BF16 * p)
        return {"weights": FP32 * (p - pe) / g + FP32 * pe / ge,
                "grads": FP32 * (p - pe) / g + FP32 * pe / ge,
                "optimizer": 2 * FP32 * (p - pe) / opt + 2 * FP32 * pe / opt_e,
                "fsdp_gathered": working, "reserved": float(self.acc.reserved_bytes)}

    def expert_weight_bytes(self, dp: int, tp: int, pp: int, zero: int, shard: int | None = None) -> float:
        """The experts' fp32 weights a rank holds (part of `static_parts`' weights)."""
        g = (shard or dp) if zero >= 2 and dp > 1 else 1
        return FP32 * self.expert_params / (tp * pp) / max(1, g // self.ep)

    def accumulation(self, dp: int, tp: int, pp: int, zero: int, m: int, shard: int | None = None) -> float:
        """FSDP2's unsharded fp32 gradients kept between micro-batches (m > 1), beyond the shard."""
        if zero < 2 or dp == 1 or m == 1:
            return 0.0
        p, pe, g = self.params / (tp * pp), self.expert_params / (tp * pp), shard or dp
        return FP32 * (p - pe) * (1 - 1 / g) + FP32 * pe * (1 - 1 / max(1, g // self.ep))

    def act_bytes(self, tp: int, pp: int, b: int, m: int, rec: bool, sched: str, v: int) -> float:
        rep_tp = tp if self.sp else 1  # sequence parallelism shards the replicated part too
        full = b * (self.act_rep / rep_tp + self.act_shard / tp)  # one layer, one micro-batch
        stored = 2 * b * self.m.seq_len * self.m.d_model / rep_tp if rec else full
        in_flight = float(m if sched == "gpipe" else min(pp, m))
        if sched == "interleaved_1f1b":
            in_flight *= 1 + (pp - 1) / (v * pp)
        working = full if rec else 0.0  # the layer recomputed during its backward pass
        return stored * (self.m.n_layers // pp) * in_flight + working + b * self.logits / tp

    # -- time --------------------------------------------------------------------

    def per_node(self, stride: int, size: int) -> int:
        """Members per node of a group of `size` ranks `stride` apart (the layout's rank
        order puts a data-parallel group's ranks tp * pp apart)."""
        ns = self.c.node_size
        if stride * size <= ns:
            return size
        return max(1, ns // stride) if ns % stride == 0 else 1

    def efficiency(self, tp: int, b: int) -> float:
        """Share of peak the layers' GEMMs reach at micro-batch `b` and TP width `tp`."""
        return self.acc.mfu_ceiling * _gemm(b * self.m.seq_len) * _gemm(self.m.d_model / tp)

    def replica_compute(self, tp: int, pp: int, b: int, m: int, rec: bool) -> float:
        """Seconds one replica (tp x pp ranks of this accelerator) computes m micro-batches of b."""
        flops = self.token_flops[rec] * self.m.seq_len * b * m
        return flops / (tp * pp * self.acc.peak_flops * self.efficiency(tp, b))

    def times(self, dp: int, tp: int, pp: int, b: int, m: int, zero: int, rec: bool, sched: str,
              v: int, shard: int | None = None
              ) -> tuple[float, float, float, float, float, float, bool, float]:
        """(compute, tp_comm, bubble, pp_p2p, dp_comm, dp_exposed, hierarchical, moe_comm) in seconds."""
        gpus = dp * tp * pp
        compute = self.step_flops[rec] / (gpus * self.acc.peak_flops * self.efficiency(tp, b))
        tp_comm, bubble, pp_p2p = self.stage_times(compute, dp, tp, pp, b, m, zero, rec, sched, v)
        dp_comm, exposed, hier = self.dp_sync(dp, tp, pp, m, zero, rec, compute + tp_comm, shard)
        moe = sum(self.moe_comm(dp, tp, pp, b, m, rec))
        return compute, tp_comm, bubble, pp_p2p, dp_comm, exposed, hier, moe

    def moe_comm(self, dp: int, tp: int, pp: int, b: int, m: int, rec: bool) -> tuple[float, float]:
        """Seconds a MoE model's blocks spend in one step on (the EP group's dispatch and
        combine all_to_alls, the routing counts' all-gather over dp), all exposed; (0, 0) dense."""
        if not self.m.is_moe or dp <= 1:
            return 0.0, 0.0
        layers, forwards = self.m.n_layers // pp, 2 if rec else 1
        # Capacity is global: every block gathers each rank's per-expert counts each forward.
        counts = self._coll("all_gather", dp * experts.routing_summary_bytes(self.m), dp,
                            self.per_node(tp * pp, dp))
        routing = forwards * counts * layers * m
        if self.ep <= 1:
            return 0.0, routing
        tokens = b * self.m.seq_len / (tp if self.sp else 1)
        k = self.per_node(tp * pp, self.ep)  # EP groups: ep consecutive replicas
        one = self._memoised(("a2a", tokens, k), experts.all_to_all_seconds, tokens, self.m, self.ep, k,
                             self.acc)
        count = experts.A2A_PER_LAYER_RECOMPUTE if rec else experts.A2A_PER_LAYER
        return count * one * layers * m, routing

    def stage_times(self, compute: float, dp: int, tp: int, pp: int, b: int, m: int, zero: int,
                    rec: bool, sched: str, v: int) -> tuple[float, float, float]:
        """(tp_comm, bubble, pp_p2p) in seconds of a replica that computes for `compute` s."""
        s, h, c = self.m.seq_len, self.m.d_model, self.c
        layers = self.m.n_layers // pp
        tp_comm = 0.0
        if tp > 1:
            per = self._coll("all_reduce", BF16 * s * b * h, tp, tp)
            tp_comm = (6 if rec else 4) * per * layers * m
        busy = compute + tp_comm + sum(self.moe_comm(dp, tp, pp, b, m, rec)) if self.m.is_moe \
            else compute + tp_comm
        bubble = busy * bubble_fraction(sched, pp, m, v)
        pp_p2p = 0.0
        if pp > 1:
            crosses = tp * pp > c.node_size or c.node_size % (tp * pp) != 0
            act = (BF16 if zero >= 2 and dp > 1 else FP32) * s * b * h
            pp_p2p = 2 * (v * m + pp - 1) * self._memoised(("p2p", act, crosses, tp), p2p, act, crosses,
                                                            tp, self.acc, c.node_size)
        return tp_comm, bubble, pp_p2p

    def dp_sync(self, dp: int, tp: int, pp: int, m: int, zero: int, rec: bool, busy: float,
                shard: int | None = None) -> tuple[float, float, bool]:
        """The data-parallel group's traffic: (dp_comm, dp_exposed, hierarchical) in seconds;
        `busy` is a replica's compute and TP time, behind which some of it hides."""
        if dp <= 1:
            return 0.0, 0.0, False
        hier = False
        if zero >= 2:
            dp_comm, exposed = self._fsdp(dp, tp, pp, m, zero, rec, busy, self.m.n_layers // pp, shard)
        elif tp == 1 and pp == 1:
            dp_comm, exposed, hier = self._ddp(dp, m, rec, busy)
        else:  # one flat all-reduce after backward
            grads = FP32 * self.params / (tp * pp)
            dp_comm = exposed = self._coll("all_reduce", grads, dp, self.per_node(tp * pp, dp))
        if zero == 1:
            sync = self._memoised(("zero1", dp, tp, pp), self._zero1_sync, dp, tp, pp)
            dp_comm += sync
            exposed += sync
        return dp_comm, exposed, hier

    def _ddp(self, dp: int, m: int, rec: bool, busy: float) -> tuple[float, float, bool]:
        """DDP's bucketed all-reduce in the last micro-batch's backward: (total, exposed, two-level)."""
        acc, k = self.acc, self.per_node(1, dp)
        grads = FP32 * self.params
        flat, two_level = self._memoised(("ddp", grads, dp, k), allreduce_costs, grads, dp, k, acc)
        if two_level < flat:  # `hierarchical_allreduce: auto` takes it; synchronous: all exposed
            return two_level, two_level, True
        # The last bucket holds the (tied) embedding, whose gradient is complete only at
        # the end of backward; at least one whole bucket.
        last_bytes = min(grads, max(DDP_BUCKET_BYTES, FP32 * (self.m.vocab_size + self.m.seq_len)
                                    * self.m.d_model))
        last = self._memoised(("ddp", last_bytes, dp, k), allreduce_costs, last_bytes, dp, k, acc)[0]
        backward = busy * (3 if rec else 2) / (4 if rec else 3) / m
        window = backward * (1 - 1 / self.m.n_layers)  # the first bucket is ready after a layer
        exposed = max(last, flat - window)
        return flat, exposed + CONTENTION * (flat - exposed), False

    def _zero1_sync(self, dp: int, tp: int, pp: int) -> float:
        """ZeroRedundancyOptimizer's parameter sync: one broadcast per fp32 tensor, after the step."""
        k = self.per_node(tp * pp, dp)
        tensors = self.layer_tensors * self.m.n_layers // pp + self.other_tensors
        return (tensors * latency("broadcast", dp, k, self.acc)
                + FP32 * self.params / (tp * pp) / bus_bandwidth(dp, k, self.acc))

    def _fsdp_parts(self, dp: int, tp: int, pp: int, shard: int | None) -> tuple[float, ...]:
        """Seconds of one layer's all-gather and reduction (reduce-scatter, and HSDP's
        all-reduce) and of the root module's (embeddings, head, final norm)."""
        g = shard or dp
        stride = tp * pp
        kg = self.per_node(stride, g)
        lp, op = self.layer_params / tp, self.other_params / (tp * pp)
        ag = self._coll("all_gather", BF16 * lp, g, kg)
        ag_root = self._coll("all_gather", BF16 * op, g, kg)
        rs = self._coll("reduce_scatter", FP32 * lp, g, kg)
        rs_root = self._coll("reduce_scatter", FP32 * op, g, kg)
        if not shard:
            return ag, ag_root, rs, rs_root
        # HSDP: all-reduce each shard across the groups, on a stream of its own (FSDP2's
        # all_reduce_stream). With the groups inside nodes and the replicas across them,
        # it takes the NICs while AG/RS take NVLink; otherwise they share a link.
        r, kr = dp // g, self.per_node(stride * g, dp // g)
        ar = self._coll("all_reduce", FP32 * lp / g, r, kr)
        ar_root = self._coll("all_reduce", FP32 * op / g, r, kr)
        split = g * stride <= self.c.node_size < dp * stride
        return ag, ag_root, (max(rs, ar) if split else rs + ar), rs_root + ar_root

    def _fsdp(self, dp: int, tp: int, pp: int, m: int, zero: int, rec: bool, busy: float, layers: int,
              shard: int | None) -> tuple[float, float]:
        """FSDP2 per block (ZeRO-2/3, HSDP with `shard`): (total collective time, exposed)."""
        ag, ag_root, reduce, reduce_root = self._memoised(("fsdp", dp, tp, pp, shard), self._fsdp_parts,
                                                          dp, tp, pp, shard)
        fwd_share = 1 / 4 if rec else 1 / 3
        f = busy * fwd_share / (m * layers)  # one layer's forward, one micro-batch
        bwd = busy * (1 - fwd_share) / (m * layers)  # its backward (with the recomputed forward)
        # Forward: ZeRO-3 gathers every micro-batch; ZeRO-2 too (resharded after each
        # backward), except under a pipeline, which keeps them gathered until the end.
        gathers = m if (zero >= 3 or pp == 1) else 1
        fwd_exposed = gathers * (ag_root + ag + (layers - 1) * max(0.0, ag - f))
        bwd_ag = ag if zero >= 3 else 0.0
        plain = bwd_ag + (layers - 1) * max(0.0, bwd_ag - bwd)  # a backward without reduction
        if pp == 1:  # the last micro-batch reduce-scatters layer by layer behind the next backward
            bwd_exposed = ((m - 1) * plain + bwd_ag + (layers - 1) * max(0.0, bwd_ag + reduce - bwd)
                           + reduce + reduce_root)
        else:  # torch.distributed.pipelining reduces every group after the last backward
            bwd_exposed = m * plain + layers * reduce + reduce_root
        total = gathers * (layers * ag + ag_root) + m * layers * bwd_ag + layers * reduce + reduce_root
        exposed = fwd_exposed + bwd_exposed
        return total, exposed + CONTENTION * max(0.0, total - exposed)
