"""The planner's analytic cost model: the memory and step time of one layout.

An analytic model, not a simulator: it ranks layouts and rejects ones that
cannot fit; calibrate `Accelerator` to trust its seconds.

Memory per GPU (bytes), `P = params / (tp * pp)` (embeddings spread evenly):
  weights 2P, gradients 2P (bf16), Adam fp32 master + m + v 12P; ZeRO-1 shards
  the optimizer over dp, ZeRO-2 also gradients, ZeRO-3 also weights
  (Rajbhandari et al. 2020, "ZeRO", Sec. 5). Activations per layer per
  micro-batch, tensor parallel without sequence parallel (Korthikanti et al.
  2022, "Reducing Activation Recomputation", Eq. 2 with d_ff in place of 4h):
  s*b*(10h + (8h + c*f)/t) + 5*a*s^2*b/t, c = 4 for GELU, 6 for SwiGLU; with
  full recompute only each layer's input (2sbh) plus one layer being recomputed.
  The first stage keeps min(pp, m) micro-batches in flight under 1F1B, times
  (1 + (pp-1)/(v*pp)) when interleaved (Korthikanti Sec. 4.2.3), m under GPipe.
  Plus fp32 logits 4*s*b*V/t and the accelerator's reserved bytes.

Step time:
  compute = training FLOPs / (gpus * peak * efficiency); FLOPs per token =
  passes * (2 * matmul params + 4*s*h*L attention) + 6*h*V logits, passes = 3
  (forward + backward) or 4 with full recompute (Narayanan et al. 2021, Sec. 5.1).
  TP: 4 ring all-reduces of s*b*h*2 bytes per layer per micro-batch (6 with
  recompute), 2(t-1)/t * bytes / NVLink, not overlapped (Shoeybi et al. 2019).
  Bubble: (pp-1)/m of the busy time for GPipe and 1F1B, (pp-1)/(v*m) for the
  interleaved schedule (Narayanan et al. 2021, Sec. 2.2).
  Pipeline sends: 2 * (v*m + pp - 1) messages of s*b*h*2/t bytes (scatter/gather
  over the TP ranks, Narayanan Sec. 4.1), over the network when stages cross nodes.
  DP: gradient bytes 2P reduced once per step for ZeRO-0/1, reduce-scattered
  every micro-batch plus one parameter all-gather for ZeRO-2, and 1.5x that
  per micro-batch for ZeRO-3 (two all-gathers + a reduce-scatter, ZeRO Sec. 7).
  Flat ring or hierarchical (in-node reduce-scatter, cross-node all-reduce,
  in-node all-gather), whichever is cheaper. What outlasts OVERLAP of the compute
  it can hide behind is exposed; the hidden part still costs CONTENTION of itself.
"""

from __future__ import annotations

from kuangchao.platform.cluster.hardware import Accelerator
from kuangchao.platform.planning.shapes import ClusterShape, ModelShape

# Fraction of the hideable window that communication really fills: the first
# gradient bucket is ready only after some backward work, and the last one after all.
OVERLAP = 0.8
# Hidden communication is not free either: it slows the compute under it by about
# this share of its own time. Without it a fully hidden ZeRO-3 would tie ZeRO-1
# and win on memory, whatever its 1.5x traffic.
CONTENTION = 0.1
# Heuristic: a GEMM dimension of x elements runs at x / (x + GEMM_KNEE) of the
# large-GEMM rate (tiles and waves underfill the SMs on thin matrices). This is
# what makes TP on a 768-wide model, or tiny micro-batches, cost something.
GEMM_KNEE = 64


def bubble_fraction(schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Idle time over busy time: (pp-1)/m, or (pp-1)/(v*m) interleaved (Narayanan et al. 2021)."""
    if pp <= 1 or schedule == "none":
        return 0.0
    v = virtual_stages if schedule == "interleaved_1f1b" else 1
    return (pp - 1) / (v * num_microbatches)


def allreduce_costs(nbytes: float, ranks: int, ranks_per_node: int, acc: Accelerator) -> tuple[float, float]:
    """Seconds for a (flat ring, hierarchical) all-reduce of `nbytes` per rank.

    `ranks_per_node` members of the group share a node. Within one node both are
    the NVLink ring. Across nodes the flat ring runs at the NIC rate; the
    hierarchical one reduce-scatters over NVLink, all-reduces 1/k of the data
    across nodes, and all-gathers over NVLink again.
    """
    if ranks <= 1:
        return 0.0, 0.0
    k = max(1, min(ranks_per_node, ranks))
    n = ranks // k
    if n <= 1:
        t = 2 * (ranks - 1) / ranks * nbytes / acc.nvlink_bytes_per_s
        return t, t
    flat = 2 * (ranks - 1) / ranks * nbytes / acc.internode_bytes_per_s
    hier = (2 * (k - 1) / k * nbytes / acc.nvlink_bytes_per_s
            + 2 * (n - 1) / n * (nbytes / k) / acc.internode_bytes_per_s)
    return flat, hier


def _gemm(x: float) -> float:
    return x / (x + GEMM_KNEE)


class CostModel:
    """Per-search constants, so the inner loop does arithmetic only."""

    def __init__(self, model: ModelShape, cluster: ClusterShape, acc: Accelerator, global_batch: int):
        self.m, self.c, self.acc, self.gb = model, cluster, acc, global_batch
        s, h = model.seq_len, model.d_model
        self.params = model.params
        self.layer_params = model.layer_params
        mlp_coef = 6 if model.arch == "llama" else 4
        # Korthikanti Eq. 2 for b = 1, split into TP-replicated and TP-sharded parts.
        self.act_rep = s * 10 * h
        self.act_shard = s * (8 * h + mlp_coef * model.ffn) + 5 * model.n_heads * s * s
        self.logits = 4 * s * model.vocab_size
        self.tokens = global_batch * s

    def static_parts(self, dp: int, tp: int, pp: int, zero: int) -> dict[str, float]:
        """Bytes that do not depend on the micro-batch."""
        p = self.params / (tp * pp)
        return {"weights": 2 * p / (dp if zero >= 3 else 1),
                "grads": 2 * p / (dp if zero >= 2 else 1),
                "optimizer": 12 * p / (dp if zero >= 1 else 1),
                # ZeRO-3 gathers whole layers: the one in use and the one prefetched.
                "zero3_buffers": 2 * 2 * self.layer_params / tp if zero >= 3 and dp > 1 else 0.0,
                "reserved": float(self.acc.reserved_bytes)}

    def act_bytes(self, tp: int, pp: int, b: int, m: int, rec: bool, sched: str, v: int) -> float:
        full = b * (self.act_rep + self.act_shard / tp)  # one layer, one micro-batch
        stored = 2 * b * self.m.seq_len * self.m.d_model if rec else full
        in_flight = float(m if sched == "gpipe" else min(pp, m))
        if sched == "interleaved_1f1b":
            in_flight *= 1 + (pp - 1) / (v * pp)
        working = full if rec else 0.0  # the layer recomputed during its backward pass
        return stored * (self.m.n_layers // pp) * in_flight + working + b * self.logits / tp

    def times(self, dp: int, tp: int, pp: int, b: int, m: int, zero: int, rec: bool, sched: str,
              v: int) -> tuple[float, float, float, float, float, float, bool]:
        """(compute, tp_comm, bubble, pp_p2p, dp_comm, dp_exposed, hierarchical) in seconds."""
        m_, c, acc = self.m, self.c, self.acc
        s, h = m_.seq_len, m_.d_model
        gpus = dp * tp * pp
        eff = acc.mfu_ceiling * _gemm(b * s) * _gemm(h / tp)
        compute = m_.flops_per_token(rec) * self.tokens / (gpus * acc.peak_flops * eff)
        act_msg = 2 * s * b * h
        tp_comm = 0.0
        if tp > 1:
            per = 2 * (tp - 1) / tp * act_msg / acc.nvlink_bytes_per_s
            tp_comm = (6 if rec else 4) * per * (m_.n_layers // pp) * m
        bubble = (compute + tp_comm) * bubble_fraction(sched, pp, m, v)
        p2p = 0.0
        if pp > 1:
            crosses = tp * pp > c.node_size or c.node_size % (tp * pp) != 0
            bw = acc.internode_bytes_per_s if crosses else acc.nvlink_bytes_per_s
            p2p = 2 * (v * m + pp - 1) * (act_msg / tp) / bw
        dp_comm, exposed, hier = 0.0, 0.0, False
        if dp > 1:
            group = tp * pp
            per_node = c.node_size // group if c.node_size % group == 0 else 1
            flat, hcost = allreduce_costs(2 * self.params / group, dp, per_node, acc)
            hier = hcost < flat
            volume = 1.0 if zero <= 1 else (0.5 * m + 0.5 if zero == 2 else 1.5 * m)
            dp_comm = volume * min(flat, hcost)
            bwd = compute * (3 if rec else 2) / (4 if rec else 3)
            # ZeRO-0/1 reduce once the last micro-batch's gradients exist; ZeRO-2
            # reduces every micro-batch; ZeRO-3 also gathers weights ahead of the forward.
            window = bwd / m if zero <= 1 else (bwd if zero == 2 else compute)
            hidden = min(dp_comm, OVERLAP * window)
            exposed = dp_comm - hidden + CONTENTION * hidden
        return compute, tp_comm, bubble, p2p, dp_comm, exposed, hier
