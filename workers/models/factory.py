"""Decoder-only language models trained by kuangchao workers.

Three built-in architectures are provided, GPT (GPT-2 style), Llama (RMSNorm,
rotary embeddings, SwiGLU) and MoE (Llama's blocks with routed SwiGLU experts).
All expose the same layout, which later work relies on to cut a model into
pipeline stages and tensor-parallel shards:

    tok_emb -> blocks[i] -> norm -> lm_head

with every block holding separate ``attn.{q,k,v,o}_proj`` and ``mlp.*_proj``
Linear layers (MoE: ``moe.router`` and ``moe.experts.{i}.*_proj``). A model can
also come from a user factory named as ``"package.module:factory"`` in
``model.type``.

This module is the entry point: it holds ``build_model`` and the import of
custom factories, and re-exports the public names of the modules the code lives
in, so ``from kuangchao.workers.models.factory import ...`` keeps working:

* ``config.py``: ``ModelConfig``, the errors and the helpers both
  architectures share;
* ``gpt.py``: ``GPT`` and its layers;
* ``llama.py``: ``Llama``, its layers, ``RMSNorm`` and the rotary embedding;
* ``moe.py``: ``MoE``, a Mixtral-like mixture of experts on Llama's blocks
  (its router maths in ``router.py``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torch import nn

from kuangchao.workers.errors import ModelConfigError, ModelInputError
from kuangchao.workers.models.config import BUILTIN_MODELS, INIT_STD, ModelConfig, check_type_name
from kuangchao.workers.models.gpt import GPT, GPTMLP, GPTAttention, GPTBlock
from kuangchao.workers.models.llama import (
    NORM_EPS,
    ROPE_THETA,
    Llama,
    LlamaAttention,
    LlamaBlock,
    LlamaMLP,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
)
from kuangchao.workers.models.moe import MoE

__all__ = [
    "BUILTIN_MODELS",
    "GPT",
    "GPTAttention",
    "GPTBlock",
    "GPTMLP",
    "INIT_STD",
    "Llama",
    "MoE",
    "LlamaAttention",
    "LlamaBlock",
    "LlamaMLP",
    "ModelConfig",
    "ModelConfigError",
    "ModelInputError",
    "NORM_EPS",
    "RMSNorm",
    "ROPE_THETA",
    "RotaryEmbedding",
    "apply_rotary",
    "build_model",
]


def build_model(cfg: ModelConfig) -> nn.Module:
    """Build the model named by ``cfg.type``.

    Args:
        cfg: Model configuration. ``cfg.type`` is ``"gpt"``, ``"llama"``,
            ``"moe"`` or ``"package.module:factory"``, where ``factory(cfg)``
            returns an ``nn.Module``.

    Returns:
        A freshly initialised model; parameters depend only on the torch seed.

    Raises:
        ModelConfigError: When the type is unknown, the factory cannot be
            imported, or it does not return an ``nn.Module``.
    """
    check_type_name(cfg.type)
    if cfg.type == "gpt":
        return GPT(cfg)
    if cfg.type == "llama":
        return Llama(cfg)
    if cfg.type == "moe":
        return MoE(cfg)
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
