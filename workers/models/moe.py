"""Mixture-of-experts decoder (`model.type: moe`): Mixtral-like, on the Llama blocks.

Each block is `attn_norm -> attn -> mlp_norm -> moe`: Llama's rotary attention,
then `MoELayer`, `n_experts` SwiGLU experts behind a top-`top_k` router, in place
of the MLP. The layout the parallel code cuts is the built-in models' own,
`tok_emb -> blocks[i] -> norm -> lm_head`, and every expert is a submodule named
by its global index (`blocks.3.moe.experts.5.up_proj`), so a checkpoint keys each
expert's full weights by that index whatever the expert-parallel size was.

The router's maths, capacity and the auxiliary losses are workers/models/router.py's.
How the tokens reach their experts is `MoELayer.comm`'s: in one process every
expert runs here; under data or expert parallelism the engine installs the
distributed one (workers/parallel/expert_parallel.py), which gathers the other
ranks' routing counts (capacity is global) and moves tokens with all_to_all.

The load-balancing and z-losses never enter the loss value the trainer reports:
each layer adds their gradient in backward (`AuxLossGrad`), scaled as the LM
loss's gradient is (`MoEState.grad_scale`: 1 / micro-batches when gradients
accumulate), so a pipeline stage adds its layers' auxiliary losses without the
last stage having to know them. `moe_stats` reports their values.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kuangchao.workers.models import config as shared
from kuangchao.workers.models.llama import LlamaAttention, LlamaMLP, RMSNorm, RotaryEmbedding
from kuangchao.workers.models.router import (
    GlobalCounts,
    balance_terms,
    capacity,
    keep_mask,
    route,
    summary,
)
from kuangchao.workers.parallel.expert_parallel import ExpertComm


class MoEState:
    """What the MoE layers of one model share: the auxiliary losses' gradient scale, and
    the routing of each training forward since the last `reset`.

    `window`, when the engine sets it (micro-batches x the layers the rank runs), keeps
    the statistics to the step's own forwards: a pipeline stage's first step also runs
    each layer once on placeholder inputs, to learn the shapes it passes on."""

    def __init__(self, n_experts: int) -> None:
        self.n_experts = n_experts
        self.grad_scale = 1.0
        self.window: int | None = None
        self.reset()

    def reset(self) -> None:
        self.records: list[tuple[torch.Tensor, int, float, float]] = []

    def record(self, glob: GlobalCounts, cap: int, top_k: int) -> None:
        load = glob.load().cpu()
        dropped = int((load - cap).clamp(min=0).sum())
        self.records.append((load, dropped, glob.aux_loss(top_k), glob.z_loss()))

    def stats(self) -> dict[str, Any]:
        kept = self.records[-self.window:] if self.window else self.records
        load = sum((r[0] for r in kept), torch.zeros(self.n_experts, dtype=torch.long))
        n = max(1, len(kept))
        return {"expert_load": [int(v) for v in load], "dropped_tokens": sum(r[1] for r in kept),
                "aux_loss": sum(r[2] for r in kept) / n, "z_loss": sum(r[3] for r in kept) / n}


class AuxLossGrad(torch.autograd.Function):
    """Identity on `out`; in backward, `aux` gets the gradient `state.grad_scale`, as if
    `aux` had been added to the (scaled) loss."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, state: MoEState) -> torch.Tensor:
        ctx.state = state
        ctx.aux_shape = aux.shape
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        scale = torch.full(ctx.aux_shape, ctx.state.grad_scale, dtype=torch.float32,
                           device=grad.device)
        return grad, scale, None


class Expert(LlamaMLP):
    """One SwiGLU expert, down(silu(gate(x)) * up(x)): Llama's MLP without its dropout
    (Mixtral's experts have none, and a mask drawn per expert would depend on which
    rank the expert runs on)."""

    def __init__(self, cfg: shared.ModelConfig) -> None:
        super().__init__(cfg)
        self.drop = nn.Identity()


class MoELayer(nn.Module):
    """Top-k routed experts with global capacity (workers/models/router.py).

    `comm` moves tokens (in one process by default; the engine installs the ranks'); `state` is
    the model's shared MoEState. Both are plain attributes, not submodules.
    """

    is_moe_layer = True

    def __init__(self, cfg: shared.ModelConfig, state: MoEState) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.capacity_factor = cfg.capacity_factor
        self.aux_loss_coef, self.z_loss_coef = cfg.aux_loss_coef, cfg.z_loss_coef
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleDict({str(i): Expert(cfg) for i in range(cfg.n_experts)})
        self.comm: Any = ExpertComm.single()
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        r = route(flat, self.router.weight, self.top_k)
        table, me = self.comm.gather(summary(r))
        glob = GlobalCounts(table, me)
        cap = capacity(glob.tokens, self.n_experts, self.top_k, self.capacity_factor)
        keep = keep_mask(r.experts, glob.offsets().to(r.experts.device), cap)
        tokens = torch.arange(flat.size(0), device=flat.device).unsqueeze(1).expand_as(keep)[keep]
        chosen = r.experts[keep]
        order = torch.argsort(chosen, stable=True)  # expert by expert, tokens in order
        tokens = tokens[order]
        y = self.comm.run(self.experts, flat[tokens], glob.kept(cap), me)
        gates = r.weights[keep][order].unsqueeze(1)
        out = flat.new_zeros(flat.shape, dtype=y.dtype).index_add(0, tokens, (y * gates).to(y.dtype))
        if self.training and torch.is_grad_enabled() and (self.aux_loss_coef or self.z_loss_coef):
            aux, z = balance_terms(r, glob, self.top_k, self.comm.dp_size)
            out = AuxLossGrad.apply(out, self.aux_loss_coef * aux + self.z_loss_coef * z,
                                    self.state)
        # Not from eval, and not again when activation checkpointing recomputes this
        # forward inside backward.
        if self.training and torch._C._current_graph_task_id() == -1:
            self.state.record(glob, cap, self.top_k)
        return out.view(shape)


class MoEBlock(nn.Module):
    """Pre-RMSNorm block: rotary attention, then the routed experts."""

    def __init__(self, cfg: shared.ModelConfig, state: MoEState) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = LlamaAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.moe = MoELayer(cfg, state)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.drop(self.moe(self.mlp_norm(x)))


class MoE(nn.Module):
    """Mixtral-like decoder: Llama's embeddings, attention and head, routed SwiGLU experts.

    Args:
        cfg: Model shape, with `n_experts`, `top_k`, `capacity_factor`,
            `aux_loss_coef` and `z_loss_coef`.
    """

    def __init__(self, cfg: shared.ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.moe_state = MoEState(cfg.n_experts)
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.seq_len)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(MoEBlock(cfg, self.moe_state) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        shared.init_weights(self, cfg.n_layers)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits and, given targets, the mean next-token cross-entropy (the LM loss
        alone: the auxiliary losses reach the gradients in backward, `moe_stats` their values)."""
        shared.check_input(idx, self.config.seq_len)
        cos, sin = self.rope(idx.size(1))
        x = self.drop(self.tok_emb(idx))
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        return logits, shared.lm_loss(logits, targets)

    def moe_stats(self) -> dict[str, Any]:
        """The routing since the last `reset_moe_stats` (the engine resets it every step).

        Returns:
            A plain dict: `expert_load`, for each expert (by global index) the tokens
            routed to it (before capacity) over the whole global micro-batch, summed
            over the micro-batches and over the MoE layers this rank runs (all of
            them, or its pipeline stage's); `dropped_tokens`, the (token, expert)
            assignments over capacity, counted the same way; `aux_loss` and `z_loss`,
            the global load-balancing and router z-losses (before their
            coefficients), averaged over those layers and micro-batches. Every
            data-parallel and expert-parallel rank of a stage reports the same numbers.
        """
        return self.moe_state.stats()

    def reset_moe_stats(self) -> None:
        self.moe_state.reset()

    def num_params(self) -> int:
        """Number of parameters (all experts, whatever this rank holds of them)."""
        return shared.count_params(self)


def moe_stats(model: nn.Module) -> dict[str, Any] | None:
    """`model.moe_stats()` for a mixture of experts, found under any wrapper; None otherwise."""
    for module in model.modules():
        state = getattr(module, "state", None)
        if getattr(module, "is_moe_layer", False) and isinstance(state, MoEState):
            return state.stats()
    return None
