"""Unit tests for kuangchao.workers.models.factory (with its gpt, llama and model_config modules)."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from kuangchao.workers.errors import ModelConfigError, ModelInputError
from kuangchao.workers.models import config as model_config
from kuangchao.workers.models import factory as model
from kuangchao.workers.models import gpt, llama, moe
from kuangchao.workers.models.factory import GPT, Llama, ModelConfig, build_model

VOCAB = 64
SEQ_LEN = 16
ARCHS = ["gpt", "llama"]


def tiny_config(model_type: str = "gpt", **overrides: object) -> ModelConfig:
    fields: dict[str, object] = dict(
        type=model_type, n_layers=2, n_heads=2, d_model=32, seq_len=SEQ_LEN, vocab_size=VOCAB
    )
    fields.update(overrides)
    return ModelConfig(**fields)  # type: ignore[arg-type]


def seeded_model(model_type: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(tiny_config(model_type))


def seeded_model_from(cfg: ModelConfig) -> Any:
    torch.manual_seed(0)
    return build_model(cfg)


def random_batch(batch: int = 4, seq_len: int = SEQ_LEN) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(123)
    tokens = torch.randint(0, VOCAB, (batch, seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


# --- forward and training --------------------------------------------------


@pytest.mark.parametrize("model_type", ARCHS)
def test_model_loss_is_near_log_vocab_when_freshly_initialised(model_type: str) -> None:
    model = seeded_model(model_type)
    x, y = random_batch()

    logits, loss = model(x, y)

    assert logits.shape == (4, SEQ_LEN, VOCAB)
    assert loss is not None and torch.isfinite(loss)
    assert abs(loss.item() - math.log(VOCAB)) < 0.3


@pytest.mark.parametrize("model_type", ARCHS)
def test_model_loss_decreases_when_trained_on_a_repeated_batch(model_type: str) -> None:
    model = seeded_model(model_type)
    x, y = random_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _, first = model(x, y)

    for _ in range(30):
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    assert loss.item() < 0.5 * first.item()


@pytest.mark.parametrize("model_type", ARCHS)
def test_model_returns_no_loss_when_targets_are_omitted(model_type: str) -> None:
    x, _ = random_batch()

    _, loss = seeded_model(model_type)(x)

    assert loss is None


@pytest.mark.parametrize("model_type", ARCHS)
def test_model_accepts_shorter_sequences_when_t_below_seq_len(model_type: str) -> None:
    x, y = random_batch(seq_len=SEQ_LEN // 2)

    logits, loss = seeded_model(model_type)(x, y)

    assert logits.shape == (4, SEQ_LEN // 2, VOCAB)
    assert loss is not None and torch.isfinite(loss)


@pytest.mark.parametrize("model_type", ARCHS)
def test_model_raises_when_sequence_exceeds_seq_len(model_type: str) -> None:
    x, _ = random_batch(seq_len=SEQ_LEN + 1)

    with pytest.raises(ModelInputError, match="model.seq_len"):
        seeded_model(model_type)(x)


@pytest.mark.parametrize("model_type", ARCHS)
def test_model_is_causal_when_future_tokens_change(model_type: str) -> None:
    model = seeded_model(model_type).eval()
    x, _ = random_batch(batch=1)
    changed = x.clone()
    changed[0, -1] = (changed[0, -1] + 1) % VOCAB

    with torch.no_grad():
        before, _ = model(x)
        after, _ = model(changed)

    torch.testing.assert_close(before[:, :-1], after[:, :-1])
    assert not torch.allclose(before[:, -1], after[:, -1])


@pytest.mark.parametrize("model_type", ARCHS)
def test_model_parameters_are_identical_when_seed_is_the_same(model_type: str) -> None:
    a, b = seeded_model(model_type, seed=7), seeded_model(model_type, seed=7)
    c = seeded_model(model_type, seed=8)

    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not all(
        torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters(), strict=True)
    )


# --- structure ---------------------------------------------------------------


def test_gpt_ties_lm_head_to_token_embedding_when_built() -> None:
    model = seeded_model("gpt")

    assert isinstance(model, GPT)
    assert model.lm_head.weight is model.tok_emb.weight
    expected = sum(p.numel() for p in model.parameters())
    assert model.num_params() == expected


def test_llama_keeps_lm_head_untied_and_rope_out_of_state_dict_when_built() -> None:
    model = seeded_model("llama")

    assert isinstance(model, Llama)
    assert model.lm_head.weight is not model.tok_emb.weight
    assert all(m.bias is None for m in model.modules() if isinstance(m, nn.Linear))
    assert not any("rope" in key for key in model.state_dict())


@pytest.mark.parametrize(
    ("model_type", "mlp_layers"),
    [("gpt", {"up_proj", "down_proj"}), ("llama", {"gate_proj", "up_proj", "down_proj"})],
)
def test_model_exposes_named_projections_when_built(model_type: str, mlp_layers: set) -> None:
    model = seeded_model(model_type)

    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == 2
    assert model.config.type == model_type
    for block in model.blocks:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert isinstance(getattr(block.attn, name), nn.Linear)
        for name in mlp_layers:
            assert isinstance(getattr(block.mlp, name), nn.Linear)


def test_gpt_scales_residual_projection_init_when_layers_are_many() -> None:
    torch.manual_seed(0)
    model = build_model(tiny_config("gpt", n_layers=8, d_model=128, n_heads=4))

    residual_std = model.blocks[0].attn.o_proj.weight.std().item()
    plain_std = model.blocks[0].attn.q_proj.weight.std().item()

    assert plain_std == pytest.approx(0.02, rel=0.1)
    assert residual_std == pytest.approx(0.02 / math.sqrt(16), rel=0.1)


@pytest.mark.parametrize(
    ("model_type", "d_ff", "expected"),
    [("gpt", None, 128), ("llama", None, 96), ("llama", 50, 50), ("gpt", 40, 40)],
)
def test_config_picks_ffn_width_when_d_ff_is_given_or_none(
    model_type: str, d_ff: int | None, expected: int
) -> None:
    cfg = tiny_config(model_type, d_ff=d_ff)

    assert cfg.ffn_dim == expected
    assert seeded_model_from(cfg).blocks[0].mlp.up_proj.out_features == expected


def test_config_rounds_llama_ffn_to_multiple_of_16_when_d_ff_is_none() -> None:
    cfg = tiny_config("llama", d_model=40, n_heads=4)

    # int(8 * 40 / 3) = 106 -> 112
    assert cfg.ffn_dim == 112


# --- configuration errors ------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n_layers", 0),
        ("n_heads", -1),
        ("d_model", 3.5),
        ("seq_len", 0),
        ("vocab_size", True),
        ("d_ff", 0),
        ("dropout", 1.0),
    ],
)
def test_config_error_names_the_field_when_value_is_invalid(field: str, value: object) -> None:
    with pytest.raises(ModelConfigError, match=rf"model\.{field}"):
        tiny_config("gpt", **{field: value})


def test_config_error_names_n_heads_when_d_model_is_not_divisible() -> None:
    with pytest.raises(ModelConfigError, match=r"model\.n_heads.*d_model=30"):
        tiny_config("gpt", d_model=30, n_heads=4)


def test_config_error_names_n_heads_when_llama_head_dim_is_odd() -> None:
    tiny_config("gpt", d_model=30, n_heads=2)  # odd head size is fine for GPT

    with pytest.raises(ModelConfigError, match=r"model\.n_heads.*even"):
        tiny_config("llama", d_model=30, n_heads=2)


def test_config_error_lists_builtins_when_type_is_unknown() -> None:
    with pytest.raises(ModelConfigError) as info:
        tiny_config("bert")

    message = str(info.value)
    assert "model.type: 'bert' is not a built-in model" in message
    assert "'gpt'" in message and "'llama'" in message and "package.module:factory" in message


def test_config_errors_are_value_errors_when_caught_generically() -> None:
    with pytest.raises(ValueError):
        tiny_config("gpt", n_layers=0)


# --- custom factories ------------------------------------------------------------


@pytest.fixture
def factory_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = "kc_test_custom_model"
    (tmp_path / f"{name}.py").write_text(
        "from kuangchao.workers.models.factory import GPT\n"
        "def make(cfg):\n"
        "    return GPT(cfg)\n"
        "def not_a_module(cfg):\n"
        "    return 42\n"
        "VALUE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_build_model_calls_factory_when_type_is_module_path(factory_module: str) -> None:
    cfg = tiny_config(f"{factory_module}:make")

    model = seeded_model_from(cfg)

    assert isinstance(model, GPT) and model.config is cfg


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("kc_no_such_module_xyz:make", "No module named 'kc_no_such_module_xyz'"),
        ("{module}:missing", "has no attribute 'missing'"),
        ("{module}:VALUE", "not callable"),
    ],
)
def test_build_model_reports_import_error_when_factory_cannot_be_imported(
    factory_module: str, spec: str, reason: str
) -> None:
    spec = spec.format(module=factory_module)

    with pytest.raises(ModelConfigError) as info:
        build_model(tiny_config(spec))

    assert str(info.value).startswith(f"model.type: cannot import '{spec}': ")
    assert reason in str(info.value)


def test_build_model_raises_when_factory_returns_a_non_module(factory_module: str) -> None:
    with pytest.raises(ModelConfigError, match="expected a torch.nn.Module"):
        build_model(tiny_config(f"{factory_module}:not_a_module"))


def test_build_model_rejects_unknown_type_when_config_bypasses_validation() -> None:
    cfg = tiny_config("gpt")
    object.__setattr__(cfg, "type", "bert")

    with pytest.raises(ModelConfigError, match="not a built-in model"):
        build_model(cfg)


def test_config_replace_revalidates_when_fields_change() -> None:
    with pytest.raises(ModelConfigError, match=r"model\.seq_len"):
        replace(tiny_config("gpt"), seq_len=-4)


def test_model_reexports_names_of_the_modules_that_define_them_when_imported() -> None:
    for name in model.__all__:
        value = getattr(model, name)
        homes = [m for m in (model_config, gpt, llama, moe) if getattr(m, name, None) is value]
        assert homes or name == "build_model", name
    assert model.ModelConfig is model_config.ModelConfig
    assert model.GPT is gpt.GPT and model.Llama is llama.Llama
