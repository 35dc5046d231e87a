"""What the planner plans over: a model's shape, the cluster's GPUs, and one plan.

Pure (stdlib only).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kuangchao.platform.spec.moe import MOE_FIELDS

if TYPE_CHECKING:
    from kuangchao.platform.cluster.topology import ClusterTopology

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
    # Grouped-query attention (Hugging Face `num_key_value_heads`); None: one per query head.
    n_kv_heads: int | None = None
    # Per-head width when a config sets it apart from d_model / n_heads (`head_dim`).
    head_dim: int | None = None
    # Whether the LM head shares the embedding; None: the arch's own (gpt tied, llama not).
    tied_head: bool | None = None
    # Mixture of experts (arch "moe", or a Hugging Face MoE config): every block's MLP is
    # `n_experts` SwiGLU experts of width d_ff behind a router, `top_k` of them per token;
    # the busiest expert takes at most `capacity_factor` x the mean (None: no cap).
    n_experts: int | None = None
    top_k: int = MOE_FIELDS["top_k"]
    capacity_factor: float | None = MOE_FIELDS["capacity_factor"]

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"model.{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("n_kv_heads", "head_dim", "d_ff"):
            value = getattr(self, name)
            if value is not None and not value >= 1:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"model.d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"model n_heads {self.n_heads} is not a multiple of the "
                             f"{self.kv_heads} key/value heads")
        if self.n_experts is not None:
            if not self.n_experts >= 1 or not 1 <= self.top_k <= self.n_experts:
                raise ValueError(f"model.top_k must be in [1, n_experts], got top_k {self.top_k} "
                                 f"with n_experts {self.n_experts}")
            if self.capacity_factor is not None and not self.capacity_factor > 0:
                raise ValueError(f"model.capacity_factor must be positive, got {self.capacity_factor!r}")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def q_dim(self) -> int:
        """Width of the queries (and of the attention output): n_heads x head size."""
        return self.n_heads * self.head_dim if self.head_dim is not None else self.d_model

    @property
    def kv_dim(self) -> int:
        """Width of the keys and of the values: kv heads x head size."""
        return self.q_dim // self.n_heads * self.kv_heads

    @property
    def tied(self) -> bool:
        return not self.swiglu if self.tied_head is None else self.tied_head

    @property
    def swiglu(self) -> bool:
        """Llama-style blocks: SwiGLU MLP (or experts), RMSNorm, no biases, untied head."""
        return self.arch in ("llama", "moe")

    @property
    def is_moe(self) -> bool:
        return self.n_experts is not None

    @property
    def expert_params(self) -> int:
        """One expert's parameters: a SwiGLU MLP (gate, up, down)."""
        return 3 * self.d_model * self.ffn if self.is_moe else 0

    @property
    def layer_expert_params(self) -> int:
        """All experts of one block; 0 for a dense model."""
        return (self.n_experts or 0) * self.expert_params

    def tp_divides(self, t: int) -> bool:
        """Whether `t` tensor-parallel ranks split the heads (query and key/value) and widths."""
        return (self.n_heads % t == 0 and self.kv_heads % t == 0 and self.d_model % t == 0
                and self.ffn % t == 0)

    @property
    def ffn(self) -> int:
        """MLP width: `d_ff`, else the architecture's default (as workers/models/config.py)."""
        if self.d_ff is not None:
            return self.d_ff
        return -(-(8 * self.d_model // 3) // 16) * 16 if self.swiglu else 4 * self.d_model

    @property
    def layer_matmul_params(self) -> int:
        """q and o (h x q_dim each), k and v (h x kv_dim each), and the MLP's 3 (SwiGLU) or 2;
        for MoE every expert and the router (h x n_experts)."""
        h, f = self.d_model, self.ffn
        attention = 2 * h * self.q_dim + 2 * h * self.kv_dim  # 4h^2 without GQA or head_dim
        if self.is_moe:
            return attention + self.layer_expert_params + h * (self.n_experts or 0)
        return attention + (3 if self.swiglu else 2) * h * f

    @property
    def layer_active_matmul_params(self) -> int:
        """The matmul parameters one token passes through: top_k experts, not all of them."""
        idle = (self.n_experts - self.top_k) if self.n_experts is not None else 0
        return self.layer_matmul_params - idle * self.expert_params

    @property
    def layer_params(self) -> int:
        h = self.d_model
        if self.swiglu:  # no biases, two RMSNorm scales
            return self.layer_matmul_params + 2 * h
        # q, k, v, o and MLP biases; 2 LayerNorms (weight and bias each)
        return self.layer_matmul_params + self.q_dim + 2 * self.kv_dim + h + self.ffn + h + 4 * h

    @property
    def params(self) -> int:
        """Distinct parameters; for GPT 12Lh^2 + 13Lh + (V + s)h + 2h at d_ff = 4h."""
        h, v = self.d_model, self.vocab_size
        head = 0 if self.tied else v * h
        if self.swiglu:  # embeddings, final RMSNorm, rotary positions (no parameters)
            return self.n_layers * self.layer_params + v * h + h + head
        # learned positions, final LayerNorm
        return self.n_layers * self.layer_params + (v + self.seq_len) * h + 2 * h + head

    @property
    def active_params(self) -> int:
        """Parameters one token uses (MoE: top_k experts per block); `params` when dense."""
        return self.params - self.n_layers * (self.layer_matmul_params - self.layer_active_matmul_params)

    def flops_per_token(self, recompute: bool) -> float:
        """Training FLOPs per token; with full recompute the layers run forward twice."""
        passes = 4 if recompute else 3
        layer = 2 * self.layer_active_matmul_params + 4 * self.seq_len * self.q_dim
        return passes * self.n_layers * layer + 6 * self.d_model * self.vocab_size

    def expert_flops_per_token(self, recompute: bool) -> float:
        """The part of `flops_per_token` spent in experts (top_k SwiGLU MLPs per block)."""
        return (4 if recompute else 3) * self.n_layers * 2 * self.top_k * self.expert_params

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
        arch = str(d.get("type") or "gpt")
        moe: dict[str, Any] = {}
        if arch == "moe":  # absent fields: the spec's defaults, as the dataclass's
            moe = {"n_experts": int(d.get("n_experts") or MOE_FIELDS["n_experts"])}
            if d.get("top_k") is not None:
                moe["top_k"] = int(d["top_k"])
            if "capacity_factor" in d:
                moe["capacity_factor"] = None if d["capacity_factor"] is None else float(d["capacity_factor"])
        return cls(int(d["n_layers"]), int(d["d_model"]), int(d["n_heads"]), int(d["seq_len"]),
                   int(d["vocab_size"]), None if d.get("d_ff") is None else int(d["d_ff"]), arch, **moe)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], seq_len: int | None = None) -> ModelShape:
        """From a Hugging Face `config.json` (as a dict), read as the platform reads it
        (`HFShape.of`): layers, heads, key/value heads, width, vocabulary, and
        `intermediate_size` (`n_inner` for GPT-2), `head_dim` and `tie_word_embeddings`
        when the config has them (an absent tie: transformers' default, tied for GPT-2 only).

        Families with `intermediate_size` (Llama, Mistral, Qwen, ...) are SwiGLU decoders
        without biases (`arch` "llama"); others are costed as GPT-2. `seq_len` defaults to
        2048, or the model's `max_position_embeddings` when that is shorter.

        Raises:
            ValueError: A key the shape needs is missing or wrong.
        """
        from kuangchao.platform.spec.model import HFShape  # pydantic: kept off the pure import

        hf = HFShape.of(dict(config))
        sub = config.get("text_config")
        text: Mapping[str, Any] = sub if isinstance(sub, Mapping) else config

        def positive(*keys: str) -> int | None:
            for key in keys:
                value = text.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
            return None

        ffn = positive("intermediate_size", "n_inner")
        arch = "llama" if text.get("intermediate_size") is not None else "gpt"
        head_dim = positive("head_dim")
        if head_dim is not None and head_dim * hf.n_heads == hf.d_model:
            head_dim = None
        tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings"))
        if not isinstance(tied, bool):  # absent: transformers' default, per family
            tied = arch == "gpt"
        if seq_len is None:
            limit = hf.max_positions if isinstance(hf.max_positions, int) and hf.max_positions > 0 \
                else None
            seq_len = min(2048, limit or 2048)
        # Mixtral's experts (`num_local_experts` of `intermediate_size`, `num_experts_per_tok`
        # a token); Hugging Face routers drop no token, so no capacity.
        experts, per_token = positive("num_local_experts"), positive("num_experts_per_tok")
        moe: dict[str, Any] = {} if experts is None else {
            "n_experts": experts, "top_k": min(experts, per_token or 2), "capacity_factor": None}
        return cls(hf.n_layers, hf.d_model, hf.n_heads, int(seq_len), hf.vocab_size, ffn, arch,
                   n_kv_heads=hf.n_kv_heads, head_dim=head_dim, tied_head=tied, **moe)


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
    # HSDP (zero 2/3): shard within groups of this many data-parallel ranks; None: all of dp.
    shard_group_size: int | None = None
    # MoE: each block's experts split over groups of this many of the dp replicas (1: none).
    expert_parallel_size: int = 1
    # Megatron's sequence parallelism in the TP group (activations sharded along the sequence).
    sequence_parallel: bool = False
    expert_weights_gb: float = 0.0  # the experts' fp32 weights this rank holds (within `memory`)

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
                "time": {k: round(v, 6) for k, v in self.time.items()},
                "shard_group_size": self.shard_group_size,
                "expert_parallel_size": self.expert_parallel_size,
                "sequence_parallel": self.sequence_parallel,
                "all_to_all_s": round(self.time.get("ep_comm", 0.0), 6),
                "expert_weights_gb_per_gpu": round(self.expert_weights_gb, 3)}

    def to_spec_parallel(self) -> dict[str, int]:
        """The spec's `parallel` fields for this plan."""
        return {"data_parallel_size": self.dp, "tensor_parallel_size": self.tp,
                "pipeline_parallel_size": self.pp, "micro_batch_size": self.micro_batch,
                "gradient_accumulation_steps": self.num_microbatches}
