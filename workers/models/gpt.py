"""GPT-2 style decoder: LayerNorm, learned positions, GELU MLP, weight-tied head.

One of the two built-in architectures ``build_model`` can return (``model.type:
gpt``). Its layout, ``tok_emb -> blocks[i] -> norm -> lm_head`` with separate
``attn.{q,k,v,o}_proj`` and ``mlp.{up,down}_proj`` Linear layers, matches
``llama.py`` so that later pipeline and tensor-parallel cuts treat both alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kuangchao.workers.models.config import (
    CausalSelfAttention,
    ModelConfig,
    check_input,
    count_params,
    init_weights,
    lm_loss,
)


class GPTAttention(CausalSelfAttention):
    """Causal multi-head self-attention with separate q/k/v/o projections."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attend(*self.project(x))


class GPTMLP(nn.Module):
    """Two-layer GELU MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = cfg.ffn_dim_for("gpt")
        self.up_proj = nn.Linear(cfg.d_model, hidden)
        self.down_proj = nn.Linear(hidden, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down_proj(F.gelu(self.up_proj(x))))


class GPTBlock(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model)
        self.attn = GPTAttention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = GPTMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """GPT-2 style decoder with learned positions and a weight-tied head.

    Args:
        cfg: Model shape; ``cfg.type`` is not consulted.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        init_weights(self, cfg.n_layers)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Compute next-token logits and, given targets, the mean cross-entropy.

        Args:
            idx: Token ids, LongTensor of shape [B, T] with T <= seq_len.
            targets: Next-token ids of shape [B, T], or None.

        Returns:
            ``(logits [B, T, vocab_size], loss or None)``.

        Raises:
            ModelInputError: When ``idx`` is not 2-D or T > seq_len.
        """
        check_input(idx, self.config.seq_len)
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        return logits, lm_loss(logits, targets)

    def num_params(self) -> int:
        """Number of distinct parameters (the tied head is counted once)."""
        return count_params(self)
