"""Configuration, errors and helpers shared by the built-in model architectures.

``ModelConfig`` and the two error types are the vocabulary every model module
speaks, and the helpers below (input check, LM loss, GPT-2 weight init,
parameter count, attention head split/merge and the ``CausalSelfAttention``
core) are used identically by ``gpt.py`` and ``llama.py``. Keeping them here lets each architecture module
hold only its own layers, and lets ``factory.py`` import both without a cycle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kuangchao.workers.errors import ModelConfigError, ModelInputError

BUILTIN_MODELS = ("gpt", "llama", "moe")
INIT_STD = 0.02


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
            (see ``ffn_dim``). For ``moe``, each expert's.
        n_experts, top_k, capacity_factor, aux_loss_coef, z_loss_coef: The
            mixture of experts' (``type: moe``, workers/models/moe.py); the other
            architectures ignore them.

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
    n_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        check_type_name(self.type)
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
        if self.type == "moe":
            _check_experts(self)
        if self.type in ("llama", "moe") and self.head_dim % 2 != 0:
            raise ModelConfigError(
                f"model.n_heads: {self.type} needs an even head size for rotary embeddings, but "
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


def _check_experts(cfg: ModelConfig) -> None:
    for name in ("n_experts", "top_k"):
        _check_positive_int(name, getattr(cfg, name))
    if cfg.top_k > cfg.n_experts:
        raise ModelConfigError(f"model.top_k: {cfg.top_k} exceeds model.n_experts ({cfg.n_experts})")
    if not cfg.capacity_factor > 0:
        raise ModelConfigError(f"model.capacity_factor: {cfg.capacity_factor} is not positive")


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelConfigError(f"model.{name}: expected a positive integer, got {value!r}")


def check_type_name(type_name: object) -> None:
    """Raise ``ModelConfigError`` unless ``type_name`` is a built-in or ``"module:attr"``."""
    if not isinstance(type_name, str):
        raise ModelConfigError(f"model.type: expected a string, got {type_name!r}")
    if type_name in BUILTIN_MODELS:
        return
    module, sep, attr = type_name.partition(":")
    if sep and module and attr:
        return
    raise ModelConfigError(
        f"model.type: {type_name!r} is not a built-in model; use 'gpt', 'llama' or 'moe', "
        f"or 'package.module:factory'"
    )


def check_input(idx: torch.Tensor, seq_len: int) -> None:
    """Raise ``ModelInputError`` unless ``idx`` is [B, T] with T <= ``seq_len``."""
    if idx.dim() != 2:
        raise ModelInputError(f"expected token ids of shape [B, T], got {tuple(idx.shape)}")
    if idx.size(1) > seq_len:
        raise ModelInputError(
            f"sequence length {idx.size(1)} exceeds model.seq_len={seq_len}; "
            f"shorten the batch or raise model.seq_len"
        )


def lm_loss(logits: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor | None:
    """Mean next-token cross-entropy, or ``None`` when there are no targets."""
    if targets is None:
        return None
    # float32 keeps the log-softmax stable when logits come out of bf16 autocast.
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def init_weights(model: nn.Module, n_layers: int) -> None:
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


def count_params(model: nn.Module) -> int:
    """Number of distinct parameters of ``model``; buffers are not counted."""
    # parameters() de-duplicates shared tensors, so a tied head is counted once.
    return sum(p.numel() for p in model.parameters())


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reshape [B, T, D] to [B, n_heads, T, D / n_heads]."""
    b, t, d = x.shape
    return x.view(b, t, n_heads, d // n_heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """Inverse of ``split_heads``: [B, H, T, hd] to [B, T, H * hd]."""
    b, h, t, hd = x.shape
    return x.transpose(1, 2).reshape(b, t, h * hd)


class CausalSelfAttention(nn.Module):
    """Causal multi-head self-attention core shared by GPT and Llama.

    Holds separate ``q_proj``/``k_proj``/``v_proj``/``o_proj`` layers (the names
    pipeline and tensor-parallel cuts rely on). Subclasses define ``forward``:
    ``project`` gives per-head q, k, v, which a subclass may transform (Llama
    rotates q and k), and ``attend`` finishes with attention and the output
    projection.

    Args:
        cfg: Model shape.
        bias: Whether the four projections have biases.
    """

    def __init__(self, cfg: ModelConfig, bias: bool) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=bias)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def qkv(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        """The query, key and value projections, in that order."""
        return self.q_proj, self.k_proj, self.v_proj

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project ``x`` [B, T, D] to q, k, v, each of shape [B, H, T, head_dim]."""
        q, k, v = (split_heads(proj(x), self.n_heads) for proj in self.qkv())
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over per-head q, k, v, then ``o_proj``; returns [B, T, D]."""
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.resid_drop(self.o_proj(merge_heads(y)))
