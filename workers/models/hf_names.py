"""Tensor names between kuangchao's models and Hugging Face's causal LMs.

Three namings of the same decoder weights (pure string work: no torch here):

- **HF**: a Hugging Face `...ForCausalLM` of the Llama family layout
  (`model.embed_tokens -> model.layers[i] -> model.norm -> lm_head`), as in its
  safetensors files: `model.layers.0.self_attn.q_proj.weight`.
- **kc**: the trainer's wrapper of such a model (children `tok_emb`, `blocks`,
  `norm`, `lm_head`), which is what its checkpoints hold:
  `blocks.0.self_attn.q_proj.weight`. Inside a block the path is the HF layer's own.
- **builtin-llama**: kuangchao's own Llama (workers/models/llama.py), whose blocks
  name their parts `attn.*`, `attn_norm`, `mlp_norm`: `blocks.0.attn.q_proj.weight`.

`builtin_llama_hf_config` gives the HF `LlamaConfig` (as the dict its config.json
holds) that computes what the built-in Llama does, so its checkpoints export to
an HF Llama folder too. The built-in GPT has no HF equivalent here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

HF, KC, BUILTIN_LLAMA, WHOLE = "hf", "kc", "builtin-llama", "whole"
NAMINGS = (HF, KC, BUILTIN_LLAMA, WHOLE)

# kc prefix -> HF prefix, for everything outside the decoder layers.
_TOP = (("tok_emb.", "model.embed_tokens."), ("norm.", "model.norm."), ("lm_head.", "lm_head."))
_KC_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# Inside one block: the built-in Llama's module path -> the HF Llama layer's.
BUILTIN_LLAMA_BLOCK = {
    "attn.q_proj": "self_attn.q_proj", "attn.k_proj": "self_attn.k_proj",
    "attn.v_proj": "self_attn.v_proj", "attn.o_proj": "self_attn.o_proj",
    "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
    "mlp.gate_proj": "mlp.gate_proj", "mlp.up_proj": "mlp.up_proj",
    "mlp.down_proj": "mlp.down_proj",
}
_HF_LLAMA_BLOCK = {v: k for k, v in BUILTIN_LLAMA_BLOCK.items()}

# The built-in Llama's constants (workers/models/llama.py: ROPE_THETA, NORM_EPS).
BUILTIN_ROPE_THETA = 10000.0
BUILTIN_NORM_EPS = 1e-5


class _UnknownTensorName(ValueError):
    """A tensor name that the mapping asked for does not know."""


def kc_to_hf(name: str) -> str:
    """`blocks.3.mlp.up_proj.weight` -> `model.layers.3.mlp.up_proj.weight`.

    Raises:
        ValueError: A name outside `tok_emb`, `blocks.N`, `norm`, `lm_head`.
    """
    m = _KC_BLOCK.match(name)
    if m:
        return f"model.layers.{m.group(1)}.{m.group(2)}"
    for kc, hf in _TOP:
        if name.startswith(kc):
            return hf + name[len(kc):]
    raise _UnknownTensorName(f"{name!r} is not a tensor of kuangchao's wrapper of a Hugging Face model "
                     "(tok_emb.*, blocks.N.*, norm.*, lm_head.*)")


def whole_to_hf(name: str) -> str:
    """`hf.transformer.h.0.attn.c_attn.weight` -> `transformer.h.0.attn.c_attn.weight`: the
    built-in trainer runs a family outside the decoder layout whole, under `hf.`."""
    if not name.startswith("hf."):
        raise _UnknownTensorName(f"{name!r} is not a tensor of a whole Hugging Face model (hf.*)")
    return name[3:]


def hf_to_kc(name: str) -> str:
    """`model.layers.3.mlp.up_proj.weight` -> `blocks.3.mlp.up_proj.weight`.

    Raises:
        ValueError: A name outside `model.embed_tokens`, `model.layers.N`, `model.norm`, `lm_head`.
    """
    m = _HF_LAYER.match(name)
    if m:
        return f"blocks.{m.group(1)}.{m.group(2)}"
    for kc, hf in _TOP:
        if name.startswith(hf):
            return kc + name[len(hf):]
    raise _UnknownTensorName(f"{name!r} is not a tensor kuangchao's wrapper of a Hugging Face model holds "
                     "(model.embed_tokens.*, model.layers.N.*, model.norm.*, lm_head.*)")


def _swap_block_path(rel: str, table: dict[str, str]) -> str | None:
    for old, new in table.items():
        if rel.startswith(old + "."):
            return new + rel[len(old):]
    return None


def builtin_llama_to_hf(name: str) -> str:
    """`blocks.0.attn_norm.weight` -> `model.layers.0.input_layernorm.weight`.

    Raises:
        ValueError: A name the built-in Llama does not have.
    """
    m = _KC_BLOCK.match(name)
    if m:
        rel = _swap_block_path(m.group(2), BUILTIN_LLAMA_BLOCK)
        if rel is None:
            raise _UnknownTensorName(f"{name!r} is not a tensor of kuangchao's built-in Llama")
        return f"model.layers.{m.group(1)}.{rel}"
    return kc_to_hf(name)


def hf_to_builtin_llama(name: str) -> str:
    """`model.layers.0.input_layernorm.weight` -> `blocks.0.attn_norm.weight`.

    Raises:
        ValueError: A name with no place in the built-in Llama.
    """
    m = _HF_LAYER.match(name)
    if m:
        rel = _swap_block_path(m.group(2), _HF_LLAMA_BLOCK)
        if rel is None:
            raise _UnknownTensorName(f"{name!r} has no place in kuangchao's built-in Llama")
        return f"blocks.{m.group(1)}.{rel}"
    return hf_to_kc(name)


_TO_HF = {HF: lambda n: n, KC: kc_to_hf, BUILTIN_LLAMA: builtin_llama_to_hf, WHOLE: whole_to_hf}


def naming_of(names: Iterable[str]) -> str | None:
    """Which naming `names` follow: BUILTIN_LLAMA, KC, else HF; None for no names.

    HF takes any names: whether they are those of the model a config describes
    is for the check against it (hf_export.match_layout), which names the tensor.

    A built-in Llama is told from the kc wrapper by its `attn_norm` / `attn.*`
    block paths (the kc mapping passes any block path through, so both fit
    those); a set with top-level tensors only counts as kc.
    """
    names = list(names)
    if not names:
        return None
    fits = []
    for naming in (BUILTIN_LLAMA, KC, HF):
        try:
            for n in names:
                _TO_HF[naming](n)
        except ValueError:
            continue
        fits.append(naming)
    if BUILTIN_LLAMA in fits and not any(_KC_BLOCK.match(n) for n in names):
        return KC  # only top-level tensors: the same in both
    return fits[0] if fits else None


def to_hf_names(names: Iterable[str], naming: str) -> dict[str, str]:
    """{name: its HF name} for every name of `naming`.

    Raises:
        ValueError: A name that naming does not know, or two names landing on one.
    """
    if naming not in _TO_HF:
        raise ValueError(f"unknown naming {naming!r}; known: {', '.join(NAMINGS)}")
    out = {n: _TO_HF[naming](n) for n in names}
    if len(set(out.values())) != len(out):
        raise _UnknownTensorName("two tensors map to the same Hugging Face name")
    return out


# -- the built-in Llama as an HF LlamaConfig ------------------------------------

def builtin_llama_ffn_dim(d_model: int, d_ff: int | None) -> int:
    """The built-in Llama's MLP width: `ModelConfig.ffn_dim_for("llama")` (config.py),
    restated here without torch (tests/unit/test_hf_export.py holds them equal)."""
    if d_ff is not None:
        return int(d_ff)
    return -(-int(8 * d_model / 3) // 16) * 16


def builtin_llama_hf_config(shape: dict[str, Any]) -> dict[str, Any]:
    """The config.json of an HF Llama that computes what the built-in Llama of `shape` does.

    Args:
        shape: The built-in's `n_layers`, `n_heads`, `d_model`, `vocab_size`,
            `seq_len` and `d_ff` (None: the default width), as a checkpoint's
            manifest records them under "model".

    Raises:
        ValueError: A field missing or not a positive integer.
    """
    def positive(key: str) -> int:
        v = shape.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"the built-in model's {key} is {v!r}, not a positive integer")
        return v

    d_model, n_heads = positive("d_model"), positive("n_heads")
    if d_model % n_heads:
        raise ValueError(f"the built-in model's d_model {d_model} is not divisible by n_heads {n_heads}")
    d_ff = shape.get("d_ff")
    if d_ff is not None:
        d_ff = positive("d_ff")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": positive("vocab_size"),
        "hidden_size": d_model,
        "intermediate_size": builtin_llama_ffn_dim(d_model, d_ff),
        "num_hidden_layers": positive("n_layers"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_heads,
        "head_dim": d_model // n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": positive("seq_len"),
        "rms_norm_eps": BUILTIN_NORM_EPS,
        # transformers 5 reads rope_parameters; older versions rope_theta.
        "rope_parameters": {"rope_type": "default", "rope_theta": BUILTIN_ROPE_THETA},
        "rope_theta": BUILTIN_ROPE_THETA,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
    }
