"""A Hugging Face causal LM, shaped like the built-in models so every layout applies.

The engine (workers/parallel/engine.py) cuts a model laid out as

    tok_emb -> blocks[i] -> norm -> lm_head   (+ rope: the rotary tables)

into pipeline chunks, splits each block's projections for tensor parallelism,
shards blocks with FSDP2 and checkpoints under those names. `HFCausalLM` gives
an `AutoModelForCausalLM` of a decoder family (Llama, Mistral, Qwen2/3) that
shape without copying a weight: its children *are* the model's embedding,
decoder layers, final norm and head. A decoder layer keeps its own submodule
names, so `blocks.3.self_attn.q_proj` is `model.layers.3.self_attn.q_proj`
in the folder (workers/models/hf_names.py maps one to the other), and the
tensor-parallel plan the config carries (`base_model_tp_plan`) applies to it
as written.

A chunk calls a block as `block(x, cos, sin)`; a forward pre-hook turns that
into the layer's own call, `layer(x, position_embeddings=(cos, sin))`, with no
mask: attention then runs causal (sdpa with `is_causal`), as training on packed
sequences wants. transformers is imported only here, only when a job uses it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kuangchao.platform.errors import SpecError
from kuangchao.platform.spec.model import (
    PIPELINE_FAMILIES,
    TP_STYLES,
    HFShape,
    ModelSection,
    params_error,
)
from kuangchao.platform.spec.model_folder import folder_field, read_config
from kuangchao.workers.errors import ModelConfigError
from kuangchao.workers.models import config as shared


class HFRotary(nn.Module):
    """`rope(seq_len) -> (cos, sin)`, from the model's own rotary embedding (its scaling included)."""

    def __init__(self, rotary: nn.Module) -> None:
        super().__init__()
        self.emb = rotary

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.emb.inv_freq
        positions = torch.arange(seq_len, device=inv_freq.device).unsqueeze(0)
        # The rotary module reads only the device and dtype of its first argument.
        probe = torch.empty(0, device=inv_freq.device, dtype=torch.float32)
        return self.emb(probe, positions)


def _as_layer_call(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook: `block(x, cos, sin)` -> `layer(x, position_embeddings=(cos, sin))`."""
    if len(args) == 3:
        x, cos, sin = args
        return (x,), {**kwargs, "position_embeddings": (cos, sin)}
    return args, kwargs


class HFCausalLM(nn.Module):
    """An HF causal LM seen as `tok_emb -> blocks -> norm -> lm_head`.

    Args:
        hf: A `...ForCausalLM` whose base model has `embed_tokens`, `layers`,
            `norm` and `rotary_emb` (the families in `PIPELINE_FAMILIES`).
        shape: Its config, read by the platform (`HFShape`).
        seq_len: The longest sequence the job trains on.
    """

    def __init__(self, hf: nn.Module, shape: HFShape, seq_len: int) -> None:
        super().__init__()
        base = getattr(hf, "model", None)
        missing = [n for n in ("embed_tokens", "layers", "norm", "rotary_emb")
                   if not hasattr(base, n)]
        if missing or not hasattr(hf, "lm_head"):
            raise ModelConfigError(
                f"model.path: a {shape.family} model has no {', '.join(missing) or 'lm_head'}; kc "
                "trains decoder models laid out as model.embed_tokens, model.layers, model.norm "
                "and lm_head (Llama, Mistral, Qwen2, Qwen3)")
        self.shape, self.seq_len = shape, seq_len
        self.hf_config = hf.config
        self.tok_emb = base.embed_tokens
        self.drop = nn.Identity()
        self.rope = HFRotary(base.rotary_emb)
        self.blocks = nn.ModuleList(base.layers)
        for block in self.blocks:
            block.register_forward_pre_hook(_as_layer_call, with_kwargs=True)
        self.norm = base.norm
        self.lm_head = hf.lm_head

    @property
    def d_model(self) -> int:
        return self.shape.d_model

    @property
    def tp_plan(self) -> dict[str, str] | None:
        """Per decoder layer: submodule path -> "colwise" | "rowwise"."""
        plan = self.shape.tp_plan
        return {k: v for k, v in plan.items() if v in TP_STYLES} if plan else None

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B, T, vocab] and, given targets, the mean cross-entropy (as the built-ins)."""
        shared.check_input(idx, self.seq_len)
        cos, sin = self.rope(idx.size(1))
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        return logits, shared.lm_loss(logits, targets)

    def num_params(self) -> int:
        return shared.count_params(self)


class HFWholeLM(nn.Module):
    """Any other `AutoModelForCausalLM` (GPT-2, Phi, Gemma, OPT ...), run whole: one chunk.

    Data parallelism and ZeRO need no cut, only the repeated layers (FSDP2 shards
    each, recompute and compile apply per layer): `blocks` names them without
    registering them twice. Tensor and pipeline parallelism are refused at
    validation for these families (platform/spec/model.py).
    """

    opaque = True  # the engine runs it as the single chunk it is
    rotary = False

    def __init__(self, hf: nn.Module, shape: HFShape, seq_len: int) -> None:
        super().__init__()
        from kuangchao.workers.parallel.prepare import find_blocks

        self.shape, self.seq_len = shape, seq_len
        self.hf = hf
        # A plain dict is no submodule: the layers keep their one name, under `hf.`.
        self.blocks = {str(i): b for i, b in enumerate(find_blocks(hf))}

    @property
    def d_model(self) -> int:
        return self.shape.d_model

    tp_plan = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] -> logits [B, T, vocab]."""
        shared.check_input(idx, self.seq_len)
        return self.hf(input_ids=idx, use_cache=False).logits

    def num_params(self) -> int:
        return shared.count_params(self)


def load_hf(folder: str | Path, *, pretrained: bool, seed: int | None = None) -> nn.Module:
    """The folder's `AutoModelForCausalLM` in fp32 with sdpa attention, read from local files only.

    `pretrained=False` builds it from config.json with a random init drawn from the
    torch seed (the caller seeds every rank alike, so all ranks start equal).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a rank never downloads
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a job log is no terminal
    kw: dict[str, Any] = {"attn_implementation": "sdpa"}
    if pretrained:
        return AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True,
                                                    dtype=torch.float32, **kw)
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    if seed is not None:
        torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kw)


def build_hf_model(m: ModelSection, seed: int | None = None) -> HFCausalLM | HFWholeLM:
    """The job's Hugging Face model, checked against its spec.

    Raises:
        ModelConfigError: The folder cannot be read, holds no causal LM of a supported
            family, or its parameter count is more than 10% off `model.params`.
    """
    folder = m.hf_folder
    assert folder is not None
    field = folder_field(m)
    try:
        shape = HFShape.of(read_config(folder, field))
    except SpecError as exc:
        raise ModelConfigError(str(exc)) from None
    except ValueError as exc:
        raise ModelConfigError(f"{field}: {folder}: {exc}") from None
    try:
        hf = load_hf(folder, pretrained=m.pretrained, seed=seed)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelConfigError(f"{field}: cannot load the model in {folder}: "
                               f"{str(exc).splitlines()[0][:300]}") from None
    base = getattr(hf, "model", None)
    # Only families whose base model does nothing between its layers but what HFCausalLM
    # does (Gemma scales its embeddings, for one) are cut; the others run whole.
    layered = shape.family in PIPELINE_FAMILIES and all(
        hasattr(base, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb"))
    model: HFCausalLM | HFWholeLM = (HFCausalLM(hf, shape, m.seq_len) if layered
                                     else HFWholeLM(hf, shape, m.seq_len))
    if m.params is not None and (err := params_error(m.params, model.num_params())):
        raise ModelConfigError(f"{err[0]}: {err[1]}")
    return model


def model_manifest(m: ModelSection, tokenizer: str | None) -> dict[str, Any]:
    """What a checkpoint's manifest records of the model (`kc checkpoint export --format hf`)."""
    if m.is_hf:
        folder = m.hf_folder
        assert folder is not None
        config = read_config(folder, folder_field(m))
        # The names the built-in trainer saves it under: cut (kc's) or whole (`hf.`).
        names = "kc" if config.get("model_type") in PIPELINE_FAMILIES else "whole"
        return {"kind": "hf", "config": config, "folder": str(folder),
                "tokenizer": str(tokenizer or folder), "names": names}
    return {"kind": "builtin", "type": m.type, "n_layers": m.n_layers, "n_heads": m.n_heads,
            "d_model": m.d_model, "vocab_size": m.vocab_size, "seq_len": m.seq_len, "d_ff": m.d_ff}
