"""The model a job trains: a built-in one, a user factory, or a Hugging Face folder.

One place decides, so the trainer, a rank's fresh start after a rollback, the
layout tests and the benchmarks all build the same model from the same spec.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from kuangchao.platform.spec.jobspec import JobSpec
from kuangchao.workers.models.factory import ModelConfig, build_model


def model_config(spec: JobSpec) -> ModelConfig:
    m = spec.model
    return ModelConfig(type=m.type, n_layers=m.n_layers, n_heads=m.n_heads, d_model=m.d_model,
                       seq_len=m.seq_len, vocab_size=m.vocab_size, dropout=m.dropout, d_ff=m.d_ff,
                       n_experts=m.n_experts, top_k=m.top_k, capacity_factor=m.capacity_factor,
                       aux_loss_coef=m.aux_loss_coef, z_loss_coef=m.z_loss_coef)


def build_job_model(spec: JobSpec) -> nn.Module:
    """The whole model, identical on every rank for the spec's seed (the caller seeds)."""
    if spec.model.is_hf:
        from kuangchao.workers.models.hf import build_hf_model

        return build_hf_model(spec.model, seed=spec.training.seed)
    return build_model(model_config(spec))


def dims(spec: JobSpec, model: nn.Module) -> tuple[int, int, int]:
    """(layers, width, vocabulary) of the model the job trains."""
    shape = getattr(model, "shape", None)
    m = spec.model
    if shape is None and m.is_hf:  # a user's function built it: the folder says
        from kuangchao.platform.spec.model_folder import folder_field, shape_of

        shape = shape_of(m.hf_folder, folder_field(m))  # type: ignore[arg-type]
    if shape is not None:  # a Hugging Face model: its folder says
        return shape.n_layers, shape.d_model, shape.vocab_size
    return m.n_layers, m.d_model, m.vocab_size


def tokenizer_folder(spec: JobSpec) -> str | None:
    """Where the job's tokenizer is: `data.tokenizer`, else a Hugging Face model's folder."""
    return spec.data.tokenizer or spec.model.hf_folder


@functools.lru_cache(maxsize=8)
def _manifest(spec_json: str) -> dict[str, Any]:
    from kuangchao.workers.models.hf import model_manifest

    spec = JobSpec.model_validate_json(spec_json)
    return model_manifest(spec.model, tokenizer_folder(spec))


def manifest_model(spec: JobSpec) -> dict[str, Any]:
    """The checkpoint manifest's `model` entry (read once per spec: config.json for HF)."""
    return _manifest(spec.model_dump_json())
