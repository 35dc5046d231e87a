"""Decoder-only language models trained by kuangchao workers.

Two built-in architectures are provided, GPT (GPT-2 style) and Llama (RMSNorm,
rotary embeddings, SwiGLU). Both expose the same layout, which later work relies
on to cut a model into pipeline stages and tensor-parallel shards:

    tok_emb -> blocks[i] -> norm -> lm_head

with every block holding separate ``attn.{q,k,v,o}_proj`` and ``mlp.*_proj``
Linear layers. A model can also come from a user factory named as
``"package.module:factory"`` in ``model.type``.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BUILTIN_MODELS = ("gpt", "llama")
INIT_STD = 0.02
ROPE_THETA = 10000.0
NORM_EPS = 1e-5


class ModelConfigError(ValueError):
    """A ``model.*`` setting is invalid or names a model that cannot be built."""


class ModelInputError(ValueError):
    """A batch handed to ``forward`` does not fit the model."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only language model.

    Attributes:
        type: ``"gpt"``, ``"llama"`` or ``"package.module:factory"``.
        n_layers: Number of transformer blocks.
        n_heads: Attention heads per block; must divide ``d_model``.
        d_model: Residual stream width.
        seq_len: Longest sequence the model accepts.
        vocab_size: Number of token ids.
        dropout: Dropout probability in [0, 1).
        d_ff: MLP hidden width; ``None`` picks the architecture default
            (see ``ffn_dim``).

    Raises:
        ModelConfigError: When a field is out of range; the message names the
            field as ``model.<field>``.
    """

    type: str
    n_layers: int
    n_heads: int
    d_model: int
    seq_len: int
    vocab_size: int
    dropout: float = 0.0
    d_ff: int | None = None

    def __post_init__(self) -> None:
        _check_type_name(self.type)
        for name in ("n_layers", "n_heads", "d_model", "seq_len", "vocab_size"):
            _check_positive_int(name, getattr(self, name))
        if self.d_ff is not None:
            _check_positive_int("d_ff", self.d_ff)
        # bool is an int subclass, so reject it explicitly alongside non-numbers.
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, int | float):
            raise ModelConfigError(f"model.dropout: expected a number, got {self.dropout!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ModelConfigError(
                f"model.dropout: {self.dropout} is outside [0, 1); use e.g. 0.0 or 0.1"
            )
        if self.d_model % self.n_heads != 0:
            raise ModelConfigError(
                f"model.n_heads: d_model={self.d_model} is not divisible by "
                f"n_heads={self.n_heads}; change model.n_heads or model.d_model"
            )
        if self.type == "llama" and self.head_dim % 2 != 0:
            raise ModelConfigError(
                f"model.n_heads: llama needs an even head size for rotary embeddings, but "
                f"d_model/n_heads = {self.d_model}/{self.n_heads} = {self.head_dim}; "
                f"change model.n_heads or model.d_model"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads

    @property
    def ffn_dim(self) -> int:
        """MLP hidden width for ``type`` (GPT's default for custom factories)."""
        return self.ffn_dim_for(self.type)

    def ffn_dim_for(self, arch: str) -> int:
        """MLP hidden width when this config builds architecture ``arch``.

        Args:
            arch: ``"gpt"`` or ``"llama"``; anything else is treated as GPT.

        Returns:
            ``d_ff`` when set; otherwise ``4 * d_model`` for GPT, and for Llama
            ``8 * d_model / 3`` rounded up to a multiple of 16 (SwiGLU has three
            matrices, so 2/3 of 4x keeps the parameter count of a 4x GELU MLP).
        """
        if self.d_ff is not None:
            return self.d_ff
        if arch == "llama":
            return _round_up(int(8 * self.d_model / 3), 16)
        return 4 * self.d_model


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelConfigError(f"model.{name}: expected a positive integer, got {value!r}")


def _check_type_name(type_name: object) -> None:
    if not isinstance(type_name, str):
        raise ModelConfigError(f"model.type: expected a string, got {type_name!r}")
    if type_name in BUILTIN_MODELS:
        return
    module, sep, attr = type_name.partition(":")
    if sep and module and attr:
        return
    raise ModelConfigError(
        f"model.type: {type_name!r} is not a built-in model; use 'gpt' or 'llama', "
        f"or 'package.module:factory'"
    )


def _check_input(idx: torch.Tensor, seq_len: int) -> None:
    if idx.dim() != 2:
        raise ModelInputError(f"expected token ids of shape [B, T], got {tuple(idx.shape)}")
    if idx.size(1) > seq_len:
        raise ModelInputError(
            f"sequence length {idx.size(1)} exceeds model.seq_len={seq_len}; "
            f"shorten the batch or raise model.seq_len"
        )


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor | None:
    if targets is None:
        return None
    # float32 keeps the log-softmax stable when logits come out of bf16 autocast.
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _init_weights(model: nn.Module, n_layers: int) -> None:
    """GPT-2 initialisation: N(0, 0.02), zero biases, residual outputs scaled down.

    Each block adds two residual contributions (attention and MLP), so their
    output projections get std 0.02 / sqrt(2 * n_layers) to keep the residual
    stream's variance roughly independent of depth.
    """
    residual_std = INIT_STD / math.sqrt(2 * n_layers)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            is_residual = name.endswith(("o_proj", "down_proj"))
            nn.init.normal_(module.weight, mean=0.0, std=residual_std if is_residual else INIT_STD)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)


def _num_params(model: nn.Module) -> int:
    # parameters() de-duplicates shared tensors, so a tied head is counted once.
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------
# GPT


class GPTAttention(nn.Module):
    """Causal multi-head self-attention with separate q/k/v/o projections."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def qkv(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        """The query, key and value projections, in that order."""
        return self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (_split_heads(proj(x), self.n_heads) for proj in self.qkv())
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.resid_drop(self.o_proj(_merge_heads(y)))


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
        _init_weights(self, cfg.n_layers)

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
        _check_input(idx, self.config.seq_len)
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        return logits, _lm_loss(logits, targets)

    def num_params(self) -> int:
        """Number of distinct parameters (the tied head is counted once)."""
        return _num_params(self)


# ---------------------------------------------------------------------------
# Llama


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


class LlamaAttention(nn.Module):
    """Causal self-attention with rotary embeddings on q and k, no biases."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def qkv(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        """The query, key and value projections, in that order."""
        return self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = (_split_heads(proj(x), self.n_heads) for proj in self.qkv())
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.resid_drop(self.o_proj(_merge_heads(y)))


class LlamaMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
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

    def __init__(self, cfg: ModelConfig) -> None:
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

    def __init__(self, cfg: ModelConfig) -> None:
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
        _init_weights(self, cfg.n_layers)

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
        _check_input(idx, self.config.seq_len)
        cos, sin = self.rope(idx.size(1))
        x = self.drop(self.tok_emb(idx))
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        return logits, _lm_loss(logits, targets)

    def num_params(self) -> int:
        """Number of parameters (buffers such as the rotary tables excluded)."""
        return _num_params(self)


def _split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    b, t, d = x.shape
    return x.view(b, t, n_heads, d // n_heads).transpose(1, 2)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    b, h, t, hd = x.shape
    return x.transpose(1, 2).reshape(b, t, h * hd)


# ---------------------------------------------------------------------------
# Factory


def build_model(cfg: ModelConfig) -> nn.Module:
    """Build the model named by ``cfg.type``.

    Args:
        cfg: Model configuration. ``cfg.type`` is ``"gpt"``, ``"llama"`` or
            ``"package.module:factory"``, where ``factory(cfg)`` returns an
            ``nn.Module``.

    Returns:
        A freshly initialised model; parameters depend only on the torch seed.

    Raises:
        ModelConfigError: When the type is unknown, the factory cannot be
            imported, or it does not return an ``nn.Module``.
    """
    _check_type_name(cfg.type)
    if cfg.type == "gpt":
        return GPT(cfg)
    if cfg.type == "llama":
        return Llama(cfg)
    factory = _import_factory(cfg.type)
    model = factory(cfg)
    if not isinstance(model, nn.Module):
        raise ModelConfigError(
            f"model.type: factory {cfg.type!r} returned {type(model).__name__}, "
            f"expected a torch.nn.Module"
        )
    return model


def _import_factory(spec: str) -> Callable[[ModelConfig], object]:
    module_name, _, attr = spec.partition(":")
    try:
        # Any failure while importing user code (SyntaxError, a missing
        # dependency, ...) is a configuration problem from the caller's view.
        factory = getattr(importlib.import_module(module_name), attr)
    except Exception as exc:
        raise ModelConfigError(f"model.type: cannot import {spec!r}: {exc}") from exc
    if not callable(factory):
        raise ModelConfigError(f"model.type: cannot import {spec!r}: {attr!r} is not callable")
    return factory
