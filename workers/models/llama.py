"""Llama-style decoder: RMSNorm, rotary positions, SwiGLU MLP, untied head.

The other built-in architecture behind ``build_model`` (``model.type: llama``),
with its own building blocks (``RMSNorm``, ``RotaryEmbedding``, ``apply_rotary``).
It keeps the same ``tok_emb -> blocks[i] -> norm -> lm_head`` layout and
projection names as ``gpt.py``; only the rotary tables are extra, passed to
every block by ``forward``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kuangchao.workers.errors import ModelConfigError
from kuangchao.workers.models import config as shared  # what every built-in model has

ROPE_THETA = 10000.0
NORM_EPS = 1e-5


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale and no bias."""

    def __init__(self, dim: int, eps: float = NORM_EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32: the mean of squares underflows/overflows in bf16.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


class RotaryEmbedding(nn.Module):
    """Precomputed rotary-embedding tables for positions [0, seq_len).

    The tables are non-persistent buffers: they are a pure function of the
    config, so keeping them out of checkpoints avoids stale copies.
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, seq_len: int, theta: float = ROPE_THETA) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # [seq_len, head_dim], rotate-half layout
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(cos, sin)`` tables of shape [seq_len, head_dim]."""
        return self.cos[:seq_len], self.sin[:seq_len]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape [B, H, T, head_dim] by position-dependent angles."""
    return (x * cos + _rotate_half(x) * sin).type_as(x)


class LlamaAttention(shared.CausalSelfAttention):
    """Causal self-attention with rotary embeddings on q and k, no biases."""

    def __init__(self, cfg: shared.ModelConfig) -> None:
        super().__init__(cfg, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.attend(q, k, v)


class LlamaMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: shared.ModelConfig) -> None:
        super().__init__()
        hidden = cfg.ffn_dim_for("llama")
        self.gate_proj = nn.Linear(cfg.d_model, hidden, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, cfg.d_model, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class LlamaBlock(nn.Module):
    """Pre-RMSNorm block; takes the rotary tables so one copy serves all blocks."""

    def __init__(self, cfg: shared.ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = LlamaAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Llama-style decoder: RMSNorm, rotary positions, SwiGLU, untied head.

    The rotary tables live once in ``self.rope``; each block receives them in
    ``forward(x, cos, sin)``, so a pipeline stage holding a slice of ``blocks``
    also needs a ``RotaryEmbedding(config.head_dim, config.seq_len)``.

    Args:
        cfg: Model shape; ``cfg.type`` is not consulted.
    """

    def __init__(self, cfg: shared.ModelConfig) -> None:
        super().__init__()
        if cfg.head_dim % 2 != 0:
            raise ModelConfigError(
                f"model.n_heads: llama needs an even head size, got {cfg.head_dim}; "
                f"change model.n_heads or model.d_model"
            )
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.seq_len)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        shared.init_weights(self, cfg.n_layers)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Compute next-token logits and, given targets, the mean cross-entropy.

        Same arguments, return value and errors as ``GPT.forward``.
        """
        shared.check_input(idx, self.config.seq_len)
        cos, sin = self.rope(idx.size(1))
        x = self.drop(self.tok_emb(idx))
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        return logits, shared.lm_loss(logits, targets)

    def num_params(self) -> int:
        """Number of parameters (buffers such as the rotary tables excluded)."""
        return shared.count_params(self)
