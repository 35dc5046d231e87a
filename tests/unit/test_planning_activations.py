"""The planner's activation terms (platform/planning/activations.py): Korthikanti et al.'s
per-layer accounting without parallelism, with tensor parallelism and with sequence
parallelism on top."""

from __future__ import annotations

import pytest

from kuangchao.platform.planning.activations import (
    activation_terms,
    layer_activation_bytes,
    sp_memory_ratio,
)

# GPT-3 175B's layer: s 2048, h 12288, 96 heads.
S, H, A = 2048, 12288, 96


def test_one_rank_stores_34_bytes_per_token_and_channel_plus_the_score_matrices():
    want = S * 1 * H * (34 + 5 * A * S / H)
    assert layer_activation_bytes(S, 1, H, A) == pytest.approx(want)
    # Neither split does anything on one rank.
    assert layer_activation_bytes(S, 1, H, A, tp=1, sequence_parallel=True) == pytest.approx(want)
    assert layer_activation_bytes(S, 4, H, A) == pytest.approx(4 * want)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_tensor_parallelism_leaves_ten_bytes_whole_and_sequence_parallelism_splits_them(t):
    tp_only = layer_activation_bytes(S, 1, H, A, tp=t)
    assert tp_only == pytest.approx(S * H * (10 + 24 / t + 5 * A * S / (H * t)))
    with_sp = layer_activation_bytes(S, 1, H, A, tp=t, sequence_parallel=True)
    assert with_sp == pytest.approx(S * H * (34 / t + 5 * A * S / (H * t)))
    # With SP everything is split: exactly 1/t of one rank's whole layer.
    assert with_sp == pytest.approx(layer_activation_bytes(S, 1, H, A) / t)


def test_the_ratio_is_megatrons_without_the_score_matrices():
    assert sp_memory_ratio(S, H, A, 2) == pytest.approx(17 / 22)
    assert round(sp_memory_ratio(S, H, A, 2), 2) == 0.77
    assert round(sp_memory_ratio(S, H, A, 4), 2) == 0.53
    # Stored s x s scores are split by TP alone, so SP's share of the saving is smaller.
    assert sp_memory_ratio(S, H, A, 4) < sp_memory_ratio(S, H, A, 4, scores=True) < 1


def test_terms_split_replicated_from_split_bytes():
    rep, split = activation_terms(S, H, A, scores=False)
    assert (rep, split) == (10 * H, 24 * H)
    assert activation_terms(S, H, A)[1] == 24 * H + 5 * A * S


@pytest.mark.parametrize("kwargs, name", [
    ({"seq_len": 0}, "seq_len"), ({"tp": 0}, "tp"), ({"micro_batch": True}, "micro_batch"),
    ({"d_model": 1.5}, "d_model"),
])
def test_bad_sizes_are_refused_by_name(kwargs, name):
    args = {"seq_len": S, "micro_batch": 1, "d_model": H, "n_heads": A, **kwargs}
    with pytest.raises(ValueError, match=f"{name} must be a positive integer"):
        layer_activation_bytes(**args)
