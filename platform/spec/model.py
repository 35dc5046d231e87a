"""The job spec's `model` section: a built-in model, a user factory, or a Hugging Face folder.

A Hugging Face model is named by a local folder (`type: hf` with `path`, or
the design documents' `type: llama` with `checkpoint`). Validation here is
pure: it never opens the folder, because the process validating a spec (an
API server, a laptop running `kc submit --dry-run`) need not see the
cluster's files. What the folder holds is checked at submission and again
when the job starts, against `hf_config_errors` below, from the folder's
`config.json` read as plain JSON: the architecture, whether the layout
splits its heads and layers, whether a tensor-parallel plan exists.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kuangchao.platform.spec.moe import moe_field_errors

BUILTIN_MODELS = ("gpt", "llama", "moe")
HF_TYPE = "hf"
IMPORT_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
# Fields whose value a Hugging Face model takes from its config.json.
SHAPE_FIELDS = ("n_layers", "n_heads", "d_model", "vocab_size", "d_ff")
# Families whose decoder is `model.embed_tokens -> model.layers[i] -> model.norm -> lm_head`
# with rotary positions from `model.rotary_emb` and nothing else between: a pipeline
# cuts these between layers and runs each stage with the same calls the model makes.
PIPELINE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# Tensor-parallel plans kept here for families whose config carries none.
FAMILY_TP_PLANS: dict[str, dict[str, str]] = {
    family: {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
             "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise",
             "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}
    for family in PIPELINE_FAMILIES
}
# The styles a tensor-parallel plan may use here (workers/parallel/tensor_parallel.py).
TP_STYLES = ("colwise", "rowwise")
# The families `type: llama` with a `checkpoint` folder accepts.
LLAMA_FAMILY = ("llama",)


class ModelSection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str = "gpt"
    n_layers: int = Field(2, ge=1, le=512)
    n_heads: int = Field(4, ge=1, le=512)
    d_model: int = Field(128, ge=8, le=65536)
    seq_len: int = Field(128, ge=2, le=131072)
    vocab_size: int = Field(256, ge=2, le=1_000_000)
    d_ff: int | None = Field(None, ge=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # A Hugging Face model: a local folder with config.json (no download at training time).
    path: str | None = Field(None, min_length=1, max_length=4096)
    # The design documents' name for that folder, with `type: llama`.
    checkpoint: str | None = Field(None, min_length=1, max_length=4096)
    # Load the folder's weights; false: its config with a seeded random init.
    pretrained: bool = True
    # The parameter count the user expects (8e9); checked against the folder at start.
    params: float | None = Field(None, gt=0, le=1e14)
    # type moe, a Mixtral-like mixture of experts (platform/spec/moe.py): experts per
    # layer, experts each token goes to, the slots each expert has per forward as a
    # multiple of an even share, and the weights of the load-balancing and router z-losses.
    n_experts: int = Field(8, ge=1, le=1024)
    top_k: int = Field(2, ge=1, le=1024)
    capacity_factor: float = Field(1.25, gt=0, le=1024)
    aux_loss_coef: float = Field(0.01, ge=0, le=100)
    z_loss_coef: float = Field(0.001, ge=0, le=100)

    @property
    def hf_folder(self) -> str | None:
        """The Hugging Face folder this model is built from, if it is one."""
        if self.type == HF_TYPE:
            return self.path or self.checkpoint
        if self.type == "llama" and self.checkpoint:
            return self.checkpoint
        return None

    @property
    def is_hf(self) -> bool:
        return self.hf_folder is not None

    @property
    def is_builtin(self) -> bool:
        return self.type in BUILTIN_MODELS and not self.is_hf


def model_errors(m: ModelSection) -> list[tuple[str, str]]:
    """The model section's own rules, each naming the field to change."""
    errs: list[tuple[str, str]] = []
    if m.type != HF_TYPE and m.type not in BUILTIN_MODELS and not IMPORT_REF.match(m.type):
        return [("model.type", f"{m.type!r} is not a built-in model; use one of "
                 f"{', '.join(BUILTIN_MODELS)}, hf (a Hugging Face folder), or a custom factory "
                 "as 'package.module:function'")]
    # Values, not `model_fields_set`: a dumped spec carries every default, and it
    # must validate again as it is.
    errs.extend(moe_field_errors(m))
    if m.is_hf:
        if m.type == HF_TYPE and m.path and m.checkpoint and m.path != m.checkpoint:
            errs.append(("model.checkpoint", "names another folder than model.path; give one"))
        for name in SHAPE_FIELDS:
            if getattr(m, name) != ModelSection.model_fields[name].default:
                errs.append((f"model.{name}", "comes from the model folder's config.json for a "
                             "Hugging Face model; remove it"))
        return errs
    if m.type == HF_TYPE:
        errs.append(("model.path", "type hf needs the model's local folder (config.json, "
                                   "weights, tokenizer); set model.path"))
    folder_only = {"path": m.path is not None, "params": m.params is not None,
                   "pretrained": not m.pretrained}
    for name, set_ in folder_only.items():
        if set_ and m.type != HF_TYPE:
            errs.append((f"model.{name}", "is for Hugging Face models only (type hf with "
                         "model.path, or type llama with model.checkpoint); remove it"))
    if m.checkpoint is not None and m.type not in ("llama", HF_TYPE):
        errs.append(("model.checkpoint", "names a pretrained folder for type llama or hf; "
                                         "remove it, or change model.type"))
    if m.d_model % m.n_heads:
        errs.append(("model.d_model", f"{m.d_model} is not divisible by model.n_heads ({m.n_heads})"))
    elif m.type in ("llama", "moe") and (m.d_model // m.n_heads) % 2:
        errs.append(("model.d_model", f"{m.type} needs an even head size for rotary embeddings; "
                     f"{m.d_model} / model.n_heads ({m.n_heads}) is odd"))
    return errs


@dataclass(frozen=True)
class HFShape:
    """What the platform needs to know of a Hugging Face config.json."""

    family: str
    architecture: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_model: int
    vocab_size: int
    max_positions: int | None
    tied: bool
    tp_plan: dict[str, str] | None  # per decoder layer: "self_attn.q_proj" -> "colwise"
    # Attention limited to this many past tokens (Mistral, Qwen with use_sliding_window).
    sliding_window: int | None = None

    @classmethod
    def of(cls, config: dict[str, Any]) -> HFShape:
        """Read the shape; `ValueError` naming the config key that is missing or wrong."""
        archs = config.get("architectures") or []
        family = config.get("model_type")
        if not isinstance(family, str) or not family:
            raise ValueError("config.json has no model_type")
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config

        def number(*keys: str) -> int:
            for key in keys:
                value = text.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
            raise ValueError(f"config.json has no positive integer {keys[0]}")

        heads = number("num_attention_heads", "n_head")
        raw_plan = text.get("base_model_tp_plan")
        plan = None
        if isinstance(raw_plan, dict) and raw_plan:
            plan = {k.split("layers.*.", 1)[1]: v for k, v in raw_plan.items()
                    if isinstance(k, str) and "layers.*." in k and isinstance(v, str)}
        plan = plan or FAMILY_TP_PLANS.get(family)
        kv = text.get("num_key_value_heads")
        return cls(family=family, architecture=str(archs[0]) if archs else "",
                   n_layers=number("num_hidden_layers", "n_layer"), n_heads=heads,
                   n_kv_heads=kv if isinstance(kv, int) and kv > 0 else heads,
                   d_model=number("hidden_size", "n_embd"), vocab_size=number("vocab_size"),
                   max_positions=text.get("max_position_embeddings"),
                   tied=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
                   tp_plan=plan, sliding_window=_window(family, text))


def _window(family: str, text: dict[str, Any]) -> int | None:
    window = text.get("sliding_window")
    on = family == "mistral" or bool(text.get("use_sliding_window"))
    return window if on and isinstance(window, int) and window > 0 else None


def hf_config_errors(m: ModelSection, shape: HFShape, tp: int, pp: int,
                     chunks: int) -> list[tuple[str, str]]:
    """What a Hugging Face model cannot take of this job: each error names the field.

    `chunks` is pipeline_parallel_size x virtual_stages."""
    errs: list[tuple[str, str]] = []
    if m.type == "llama" and shape.family not in LLAMA_FAMILY:
        errs.append(("model.checkpoint", f"holds a {shape.family!r} model, not a Llama-family "
                     f"one; use type hf with model.path for it"))
    if not shape.architecture.endswith(("ForCausalLM", "LMHeadModel")):
        errs.append(("model.path", f"holds a {shape.architecture or 'model without architectures'}"
                     f", not a causal language model (…ForCausalLM)"))
    if tp > 1:
        if shape.family not in PIPELINE_FAMILIES:
            errs.append(("parallel.tensor_parallel_size", f"kc splits the attention and MLP of "
                         f"{', '.join(PIPELINE_FAMILIES)} models; {shape.family} runs with data "
                         "parallelism and ZeRO (tensor_parallel_size: 1)"))
        elif shape.tp_plan is None:
            errs.append(("parallel.tensor_parallel_size", f"{shape.family} models carry no "
                         "tensor-parallel plan (base_model_tp_plan) and kc keeps none for them; "
                         "use tensor_parallel_size: 1 with ZeRO or a pipeline"))
        odd = sorted({style for style in (shape.tp_plan or {}).values()
                      if style not in TP_STYLES and "replicat" not in style})
        if odd:
            errs.append(("parallel.tensor_parallel_size", f"the model's tensor-parallel plan uses "
                         f"{', '.join(odd)}, which kc does not apply (only colwise and rowwise); "
                         "use tensor_parallel_size: 1 with ZeRO or a pipeline"))
        for what, n in (("attention heads", shape.n_heads), ("key/value heads", shape.n_kv_heads)):
            if n % tp:
                errs.append(("parallel.tensor_parallel_size",
                             f"{tp} does not divide the model's {n} {what}"))
    if pp > 1:
        if shape.family not in PIPELINE_FAMILIES:
            errs.append(("parallel.pipeline_parallel_size", f"a pipeline cuts {', '.join(PIPELINE_FAMILIES)} "
                         f"models between decoder layers; {shape.family} runs with "
                         "data or tensor parallelism and ZeRO"))
        if shape.n_layers % chunks:
            errs.append(("parallel.pipeline_parallel_size", f"{chunks} model chunks do not divide "
                         f"the model's {shape.n_layers} decoder layers"))
    if shape.sliding_window is not None and m.seq_len > shape.sliding_window:
        errs.append(("model.seq_len", f"{m.seq_len} exceeds the model's sliding_window "
                     f"({shape.sliding_window}); kc trains with full causal attention, which equals "
                     "the model's only up to its window: use a seq_len within it"))
    if shape.max_positions is not None and isinstance(shape.max_positions, int) \
            and m.seq_len > shape.max_positions:
        errs.append(("model.seq_len", f"{m.seq_len} exceeds the model's max_position_embeddings "
                                      f"({shape.max_positions})"))
    return errs


def params_error(expected: float, actual: int) -> tuple[str, str] | None:
    """`model.params` more than 10% off the folder's count."""
    if abs(actual - expected) <= 0.1 * expected:
        return None
    return ("model.params", f"{expected:.4g} is more than 10% off the {actual:,} parameters "
                            "the model folder holds; fix model.params or model.checkpoint")
