"""Auto-parallel planner: pick (dp, tp, pp, micro-batch, ZeRO, recompute, schedule)
from the model and the hardware instead of asking the user to hand-tune it.

Pure (stdlib only). An analytic cost model, not a simulator: it ranks layouts
and rejects ones that cannot fit; calibrate `Accelerator` to trust its seconds.
Ranks are laid out as the placement solver does, rank = (d * pp + s) * tp + t:
TP innermost (never across a node), then pipeline stages, then replicas.

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

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kuangchao.platform.cluster.hardware import Accelerator

if TYPE_CHECKING:
    from kuangchao.platform.cluster.topology import ClusterTopology

SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe")
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
# Plans whose predicted times differ by less than this are ties (less memory wins).
TIE_S = 1e-9

# GPT-3 shapes (Brown et al. 2020, Table 2.1; heads chosen so heads divide d_model):
# nominal params, layers, d_model, heads.
_GPT3 = ((125e6, 12, 768, 12), (350e6, 24, 1024, 16), (760e6, 24, 1536, 16),
         (1.3e9, 24, 2048, 16), (2.7e9, 32, 2560, 32), (6.7e9, 32, 4096, 32),
         (13e9, 40, 5120, 40), (175e9, 96, 12288, 96))


@dataclass(frozen=True)
class ModelShape:
    """The transformer dimensions the cost model needs (names as in the spec's `model`)."""

    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    vocab_size: int
    d_ff: int | None = None
    arch: str = "gpt"  # "llama": SwiGLU, untied head, no biases; anything else is GPT-2 style

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"model.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model {self.d_model} is not divisible by n_heads {self.n_heads}")

    @property
    def ffn(self) -> int:
        """MLP width: `d_ff`, else the architecture's default (as workers/models/config.py)."""
        if self.d_ff is not None:
            return self.d_ff
        return -(-(8 * self.d_model // 3) // 16) * 16 if self.arch == "llama" else 4 * self.d_model

    @property
    def layer_matmul_params(self) -> int:
        h, f = self.d_model, self.ffn
        return 4 * h * h + (3 if self.arch == "llama" else 2) * h * f

    @property
    def layer_params(self) -> int:
        h = self.d_model
        if self.arch == "llama":  # no biases, two RMSNorm scales
            return self.layer_matmul_params + 2 * h
        return self.layer_matmul_params + 4 * h + self.ffn + h + 4 * h  # qkvo, MLP biases; 2 LayerNorms

    @property
    def params(self) -> int:
        """Distinct parameters; for GPT 12Lh^2 + 13Lh + (V + s)h + 2h at d_ff = 4h."""
        h, v = self.d_model, self.vocab_size
        if self.arch == "llama":  # untied head, final norm, rotary positions (no parameters)
            return self.n_layers * self.layer_params + 2 * v * h + h
        return self.n_layers * self.layer_params + (v + self.seq_len) * h + 2 * h  # tied head

    def flops_per_token(self, recompute: bool) -> float:
        """Training FLOPs per token; with full recompute the layers run forward twice."""
        passes = 4 if recompute else 3
        layer = 2 * self.layer_matmul_params + 4 * self.seq_len * self.d_model
        return passes * self.n_layers * layer + 6 * self.d_model * self.vocab_size

    @classmethod
    def from_param_count(cls, n: float, seq_len: int, vocab_size: int) -> ModelShape:
        """A GPT-like shape of about `n` parameters: the GPT-3 table when within 10%,
        else the nearest entry's width/depth ratio, d_model a multiple of 128 (1024 when wide)."""
        if n <= 0:
            raise ValueError(f"parameter count must be positive, got {n!r}")
        nominal, layers, width, heads = min(_GPT3, key=lambda r: abs(math.log(n / r[0])))
        if abs(math.log(n / nominal)) <= math.log(1.1):
            return cls(layers, width, heads, seq_len, vocab_size)
        aspect = width / layers
        h = 128.0
        for _ in range(4):  # body = 12 L h^2 with h = aspect * L, i.e. 12 h^3 / aspect
            body = max(n - (vocab_size + seq_len) * h, 12 * 128**2)
            h = (aspect * body / 12) ** (1 / 3)
        # Wide models: d_model a multiple of 1024, so 128-wide heads come in multiples
        # of 8 and tp = 8 divides them; narrow ones: multiples of 128, 64-wide heads.
        quantum = 1024 if h >= 2048 else 128
        width = max(128, round(h / quantum) * quantum)
        layers = max(1, round(body / (12 * width * width)))
        return cls(layers, width, width // (128 if width >= 2048 else 64), seq_len, vocab_size)

    @classmethod
    def from_spec_model(cls, d: Mapping[str, Any]) -> ModelShape:
        """From a job spec's `model` section (or a whole spec dict holding one)."""
        if isinstance(d.get("model"), Mapping):
            d = d["model"]
        missing = [k for k in ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size") if k not in d]
        if missing:
            raise ValueError(f"model section lacks {', '.join(missing)}")
        return cls(int(d["n_layers"]), int(d["d_model"]), int(d["n_heads"]), int(d["seq_len"]),
                   int(d["vocab_size"]), None if d.get("d_ff") is None else int(d["d_ff"]),
                   str(d.get("type") or "gpt"))


@dataclass(frozen=True)
class ClusterShape:
    """GPUs available to the job; nodes are uniform, a single partial node is allowed."""

    gpus: int
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"gpus ({self.gpus}) and gpus_per_node ({self.gpus_per_node}) must be >= 1")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"{self.gpus} GPUs is not a whole number of {self.gpus_per_node}-GPU nodes")

    @property
    def node_size(self) -> int:
        """GPUs that share NVLink: a node, or all of them when there is less than one."""
        return min(self.gpus, self.gpus_per_node)

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    @classmethod
    def from_topology(cls, topo: ClusterTopology) -> ClusterShape:
        sizes = {n.gpus for n in topo.nodes if n.alive and n.gpus > 0}
        if len(sizes) != 1:
            raise ValueError(f"topology {topo.name!r}: need alive nodes with one GPU count, "
                             f"got {sorted(sizes)}")
        per = sizes.pop()
        return cls(per * sum(1 for n in topo.nodes if n.alive and n.gpus == per), per)


@dataclass(frozen=True)
class Plan:
    """One layout and its predicted cost. The first ten fields are the JSON contract."""

    dp: int
    tp: int
    pp: int
    micro_batch: int
    zero_stage: int
    recompute: bool
    schedule: str  # "none" when pp == 1
    memory_gb_per_gpu: float  # decimal GB (1e9 bytes)
    predicted_step_s: float
    predicted_tflops_per_gpu: float  # hardware FLOPs, recompute included (as Narayanan et al.)
    virtual_stages: int = 1
    num_microbatches: int = 1  # = the spec's gradient_accumulation_steps
    fits: bool = True
    hierarchical_allreduce: bool = False
    memory_bytes: int = 0
    mfu: float = 0.0  # model FLOPs (no recompute) / peak
    memory: dict[str, float] = field(default_factory=dict, compare=False)  # GB by kind
    time: dict[str, float] = field(default_factory=dict, compare=False)  # seconds by kind

    def to_json(self) -> dict[str, Any]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "micro_batch": self.micro_batch,
                "zero_stage": self.zero_stage, "recompute": self.recompute, "schedule": self.schedule,
                "memory_gb_per_gpu": round(self.memory_gb_per_gpu, 2),
                "predicted_step_s": round(self.predicted_step_s, 6),
                "predicted_tflops_per_gpu": round(self.predicted_tflops_per_gpu, 1),
                "virtual_stages": self.virtual_stages, "num_microbatches": self.num_microbatches,
                "fits": self.fits, "hierarchical_allreduce": self.hierarchical_allreduce,
                "memory_bytes": self.memory_bytes, "mfu": round(self.mfu, 4),
                "memory": {k: round(v, 3) for k, v in self.memory.items()},
                "time": {k: round(v, 6) for k, v in self.time.items()}}

    def to_spec_parallel(self) -> dict[str, int]:
        """The spec's `parallel` fields for this plan."""
        return {"data_parallel_size": self.dp, "tensor_parallel_size": self.tp,
                "pipeline_parallel_size": self.pp, "micro_batch_size": self.micro_batch,
                "gradient_accumulation_steps": self.num_microbatches}


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


class _Model:
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


def _tp_options(model: ModelShape, cluster: ClusterShape) -> list[int]:
    out, t = [], 1
    while t <= cluster.node_size:
        if cluster.node_size % t == 0 and model.n_heads % t == 0 and model.d_model % t == 0 \
                and model.ffn % t == 0:
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


def _build(ctx: _Model, dp: int, tp: int, pp: int, b: int, zero: int, rec: bool, sched: str, v: int,
           budget: int) -> Plan:
    m = ctx.gb // (dp * b)
    memory = ctx.static_parts(dp, tp, pp, zero)
    memory["activations"] = ctx.act_bytes(tp, pp, b, m, rec, sched, v)
    total = sum(memory.values())
    compute, tp_comm, bubble, p2p, dp_comm, exposed, hier = ctx.times(dp, tp, pp, b, m, zero, rec, sched, v)
    step = compute + tp_comm + bubble + p2p + exposed
    gpus = dp * tp * pp
    flops = ctx.m.flops_per_token(rec) * ctx.tokens
    model_flops = ctx.m.flops_per_token(False) * ctx.tokens
    time = {"compute": compute, "tp_comm": tp_comm, "bubble": bubble, "pp_p2p": p2p,
            "dp_comm": dp_comm, "dp_exposed": exposed}
    return Plan(dp, tp, pp, b, zero, rec, sched, total / 1e9, step, flops / step / gpus / 1e12,
                virtual_stages=v, num_microbatches=m, fits=total <= budget, hierarchical_allreduce=hier,
                memory_bytes=math.ceil(total), mfu=model_flops / step / gpus / ctx.acc.peak_flops,
                memory={k: x / 1e9 for k, x in memory.items()}, time=time)


def plan(model: ModelShape, cluster: ClusterShape, acc: Accelerator, global_batch: int, *,
         zero_stages: Iterable[int] = (0, 1, 2, 3), schedules: Iterable[str] = SCHEDULES,
         top: int | None = None, memory_headroom: float = 0.9) -> list[Plan]:
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

    Returns:
        Plans that fit; empty when none does.
    """
    zero_stages, schedules = sorted(set(zero_stages)), list(dict.fromkeys(schedules))
    _check_args(global_batch, zero_stages, schedules, memory_headroom)
    ctx = _Model(model, cluster, acc, global_batch)
    budget = math.floor(memory_headroom * acc.hbm_bytes)  # whole bytes: ceil(memory) <= budget
    found: list[tuple[float, float, tuple[int, int, int, int, int, bool, str, int]]] = []
    for tp in _tp_options(model, cluster):
        for pp in (p for p in range(1, model.n_layers + 1) if model.n_layers % p == 0):
            if cluster.gpus % (tp * pp) or global_batch % (cluster.gpus // (tp * pp)):
                continue
            dp = cluster.gpus // (tp * pp)
            batches = [1 << i for i in range(global_batch.bit_length()) if global_batch % (dp << i) == 0]
            scheds = _schedules(model, pp, schedules)
            for zero in ((0,) if dp == 1 else zero_stages):
                static = sum(ctx.static_parts(dp, tp, pp, zero).values())
                if static > budget:  # no micro-batch can help; skip the layout early
                    continue
                for rec in (False, True):
                    for sched, v in scheds:
                        for b in batches:  # memory never shrinks as b grows: stop at the first miss
                            m = global_batch // (dp * b)
                            if sched == "interleaved_1f1b" and m % pp:
                                continue  # Megatron: micro-batches must be a multiple of pp
                            mem = static + ctx.act_bytes(tp, pp, b, m, rec, sched, v)
                            if mem > budget:
                                break
                            t = ctx.times(dp, tp, pp, b, m, zero, rec, sched, v)
                            step = t[0] + t[1] + t[2] + t[3] + t[5]
                            found.append((step, mem, (dp, tp, pp, b, zero, rec, sched, v)))
    found.sort(key=lambda f: (round(f[0] / TIE_S), f[1]))
    return [_build(ctx, *key, budget=budget) for _, _, key in found[:top]]


def evaluate(model: ModelShape, cluster: ClusterShape, acc: Accelerator, global_batch: int, *,
             tp: int, pp: int, micro_batch: int, zero_stage: int = 0, recompute: bool = False,
             schedule: str | None = None, virtual_stages: int = 1,
             memory_headroom: float = 0.9) -> Plan:
    """Score one given layout (e.g. a hand-written spec), fitting or not (see `Plan.fits`).

    Raises:
        ValueError: When the layout is not one `plan()` could produce.
    """
    schedule = schedule or ("none" if pp == 1 else "1f1b")
    _check_args(global_batch, [zero_stage], [] if pp == 1 else [schedule], memory_headroom)
    if tp not in _tp_options(model, cluster):
        raise ValueError(f"tp={tp} must be a power of two dividing the node ({cluster.node_size} GPUs), "
                         f"n_heads, d_model and d_ff")
    if model.n_layers % pp or cluster.gpus % (tp * pp):
        raise ValueError(f"pp={pp} must divide n_layers ({model.n_layers}) and gpus / tp")
    dp = cluster.gpus // (tp * pp)
    if micro_batch < 1 or global_batch % (dp * micro_batch):
        raise ValueError(f"global_batch {global_batch} is not a multiple of dp * micro_batch "
                         f"= {dp * micro_batch}")
    if (schedule, virtual_stages) not in _schedules(model, pp, [schedule] if pp > 1 else []):
        raise ValueError(f"schedule {schedule!r} with virtual_stages={virtual_stages} is not valid "
                         f"for pp={pp} and {model.n_layers} layers")
    ctx = _Model(model, cluster, acc, global_batch)
    return _build(ctx, dp, tp, pp, micro_batch, zero_stage if dp > 1 else 0, recompute, schedule,
                  virtual_stages, math.floor(memory_headroom * acc.hbm_bytes))


def describe(p: Plan) -> str:
    """One line, e.g. for `kc plan` output."""
    sched = p.schedule + (f" v={p.virtual_stages}" if p.schedule == "interleaved_1f1b" else "")
    return (f"dp={p.dp} tp={p.tp} pp={p.pp} ({sched}) micro_batch={p.micro_batch} x{p.num_microbatches} "
            f"zero={p.zero_stage} recompute={'on' if p.recompute else 'off'}: "
            f"{p.memory_gb_per_gpu:.1f} GB/GPU, {p.predicted_step_s:.3g} s/step, "
            f"{p.predicted_tflops_per_gpu:.3g} TFLOP/s/GPU (MFU {p.mfu:.0%})"
            + ("" if p.fits else " [does not fit]"))
