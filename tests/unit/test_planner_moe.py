"""The planner for a mixture of experts: parameters and FLOPs, expert parallelism's
all-to-all and memory, sequence parallelism's activations, and what `auto` and
`kc plan` make of them (platform/planning/experts.py)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kuangchao.api.cli import main
from kuangchao.platform.cluster.hardware import get_accelerator
from kuangchao.platform.planning import autoplan
from kuangchao.platform.planning.activations import activation_terms, sp_memory_ratio
from kuangchao.platform.planning.comm import latency
from kuangchao.platform.planning.cost import CostModel
from kuangchao.platform.planning.experts import all_to_all_bytes, imbalance
from kuangchao.platform.planning.planner import describe, evaluate, plan
from kuangchao.platform.planning.shapes import ClusterShape, ModelShape
from kuangchao.platform.spec.jobspec import validate_spec

H100 = get_accelerator("h100-80gb")
# Mixtral 8x7B (Jiang et al. 2024): 46.7B parameters, 12.9B active per token.
MIXTRAL = ModelShape(32, 4096, 32, 4096, 32000, 14336, "moe", n_kv_heads=8, n_experts=8, top_k=2)
# 64 experts of 14336 in each of 4 blocks, multi-query attention (no TP): its ZeRO-0 states
# fit 16 H100s only with the experts split over the replicas.
WIDE = ModelShape(4, 4096, 8, 4096, 32000, 14336, "moe", n_kv_heads=1, n_experts=64, top_k=2)
# Long sequences: the activations, not the weights, decide what fits.
LONG = ModelShape(8, 4096, 32, 16384, 32000, 14336, "moe", n_kv_heads=8, n_experts=8, top_k=2)


def test_moe_parameters_are_mixtrals():
    assert MIXTRAL.params / 1e9 == pytest.approx(46.7, abs=0.05)
    assert MIXTRAL.active_params / 1e9 == pytest.approx(12.9, abs=0.05)


def test_a_hugging_face_mixtral_config_counts_its_experts_but_gets_no_ep():
    config = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 4096,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "intermediate_size": 14336, "vocab_size": 32000, "num_local_experts": 8,
              "num_experts_per_tok": 2, "tie_word_embeddings": False}
    shape = ModelShape.from_hf_config(config, 4096)
    assert (shape.params, shape.active_params) == (MIXTRAL.params, MIXTRAL.active_params)
    assert shape.capacity_factor is None  # Hugging Face routers drop no token
    # The worker runs a Hugging Face model whole: no expert parallelism to plan.
    assert all(p.expert_parallel_size == 1 for p in plan(shape, ClusterShape(64, 8), H100, 256, top=20))


def test_moe_param_count_matches_the_built_model():
    torch = pytest.importorskip("torch")
    from kuangchao.workers.models.config import ModelConfig
    from kuangchao.workers.models.factory import build_model

    torch.manual_seed(0)
    for n_experts, top_k, d_ff in ((4, 2, None), (6, 1, 48)):
        cfg = ModelConfig(type="moe", n_layers=2, n_heads=4, d_model=64, seq_len=32, vocab_size=101,
                          d_ff=d_ff, n_experts=n_experts, top_k=top_k)
        built = build_model(cfg)
        shape = ModelShape.from_spec_model({"type": "moe", "n_layers": 2, "n_heads": 4, "d_model": 64,
                                            "seq_len": 32, "vocab_size": 101, "d_ff": d_ff,
                                            "n_experts": n_experts, "top_k": top_k})
        assert shape.params == sum({id(p): p.numel() for p in built.parameters()}.values())


def test_flops_per_token_count_top_k_experts_and_the_router():
    h, f, s = MIXTRAL.d_model, MIXTRAL.ffn, MIXTRAL.seq_len
    attention = 2 * h * h + 2 * h * (h // 4)  # 8 key/value heads of 32
    layer = 2 * (attention + 2 * 3 * h * f + h * 8) + 4 * s * h
    assert MIXTRAL.flops_per_token(False) == 3 * 32 * layer + 6 * h * 32000
    assert MIXTRAL.expert_flops_per_token(False) == 3 * 32 * 2 * 2 * 3 * h * f


def test_imbalance_is_the_busiest_ranks_share_bounded_by_the_group():
    assert imbalance(1.25, 1) == 1.0  # each rank runs every expert on its own tokens
    assert imbalance(1.25, 8) == 1.25
    assert imbalance(4.0, 2) == 2.0  # a rank cannot receive more than every token
    assert imbalance(None, 4) == 4.0  # no capacity: only the group bounds it


def test_the_ep_all_to_all_matches_a_hand_computation():
    cluster = ClusterShape(8, 8)
    p = evaluate(MIXTRAL, cluster, H100, 16, tp=1, pp=1, micro_batch=1, zero_stage=3,
                 expert_parallel_size=8)
    tokens = 1 * 4096  # one micro-batch of one sequence, no TP
    wire = tokens * 2 * 4096 * 2 * 7 / 8  # top_k copies of d_model bf16 values, 7/8 leave the rank
    assert all_to_all_bytes(tokens, 2, 4096, 8) == wire
    one = latency("all_to_all", 8, 8, H100) + wire / H100.nvlink_bytes_per_s  # inside one node
    assert latency("all_to_all", 8, 8, H100) == H100.base_latency_s + H100.hop_latency_s
    # Dispatch and combine, forward and backward, in each of 32 blocks, over 2 micro-batches.
    assert p.time["ep_comm"] == pytest.approx(4 * one * 32 * 2, rel=1e-12)
    assert p.to_json()["all_to_all_s"] == pytest.approx(p.time["ep_comm"], abs=1e-6)
    with_rec = evaluate(MIXTRAL, cluster, H100, 16, tp=1, pp=1, micro_batch=1, zero_stage=3,
                        expert_parallel_size=8, recompute=True)
    assert with_rec.time["ep_comm"] == pytest.approx(6 * one * 32 * 2, rel=1e-12)


def test_an_ep_group_across_nodes_pays_for_the_network():
    inside = evaluate(MIXTRAL, ClusterShape(16, 8), H100, 32, tp=1, pp=1, micro_batch=1,
                      zero_stage=3, expert_parallel_size=8)
    across = evaluate(MIXTRAL, ClusterShape(16, 8), H100, 32, tp=1, pp=2, micro_batch=1,
                      zero_stage=3, expert_parallel_size=8)  # 8 replicas of 2 stages: 2 nodes
    def per_block(p):  # one block's all-to-alls for one micro-batch
        return p.time["ep_comm"] / (32 // p.pp) / p.num_microbatches

    # One NIC's share (50 GB/s) against NVLink (450 GB/s): several times slower.
    assert per_block(across) > 5 * per_block(inside)


def test_expert_parallelism_splits_the_experts_weights_and_adds_the_wait():
    cluster = ClusterShape(16, 8)
    kw = dict(tp=1, pp=1, micro_batch=1, zero_stage=0)
    alone, split = (evaluate(WIDE, cluster, H100, 16, expert_parallel_size=ep, **kw) for ep in (1, 16))
    experts_fp32 = 4 * WIDE.n_layers * WIDE.layer_expert_params
    assert alone.expert_weights_gb * 1e9 == pytest.approx(experts_fp32, rel=1e-9)
    assert split.expert_weights_gb * 1e9 == pytest.approx(experts_fp32 / 16, rel=1e-9)
    saved = (alone.memory["weights"] - split.memory["weights"]) * 1e9
    assert saved == pytest.approx(experts_fp32 * 15 / 16, rel=1e-9)
    assert alone.time["expert_wait"] == 0 and alone.time["ep_comm"] == 0
    # The busiest rank holds up to 1.25x the mean: its experts' FLOPs, 1.25x.
    expert_share = WIDE.expert_flops_per_token(False) / WIDE.flops_per_token(False)
    wait = split.time["expert_wait"] / (split.time["compute"] - split.time["expert_wait"])
    assert wait == pytest.approx(0.25 * expert_share, rel=1e-9)
    assert describe(split).count("all-to-all") == 1 and " ep=16 " in describe(split)


def test_auto_chooses_ep_for_a_moe_that_does_not_fit_without_it():
    cluster = ClusterShape(16, 8)
    assert plan(WIDE, cluster, H100, 64, zero_stages=(0,), expert_parallel=1) == []
    plans = plan(WIDE, cluster, H100, 64, zero_stages=(0,))
    assert plans and all(p.expert_parallel_size > 1 and p.fits for p in plans)
    assert all(p.dp % p.expert_parallel_size == 0 and 64 % p.expert_parallel_size == 0 for p in plans)
    # Expert parallelism runs without ZeRO-1 and HSDP (platform/spec/moe.py).
    for p in plan(MIXTRAL, ClusterShape(64, 8), H100, 256, top=200):
        if p.expert_parallel_size > 1:
            assert p.zero_stage != 1 and p.shard_group_size is None


def test_sp_cuts_activations_by_megatrons_ratio_at_the_same_tp_time():
    gpt = ModelShape(24, 2048, 16, 2048, 50257)  # d_ff = 4h: Korthikanti's own shape
    off, on = (CostModel(gpt, ClusterShape(8, 8), H100, 8, sp=sp) for sp in (False, True))
    rep, split = activation_terms(2048, 2048, 16, scores=False)
    assert (off.act_rep, off.act_shard) == (2048 * rep, 2048 * split)  # the same accounting

    def layers(ctx: CostModel) -> float:  # the blocks' share: the logits stay as they are
        return ctx.act_bytes(4, 1, 1, 1, False, "none", 1) - ctx.logits / 4

    assert layers(on) / layers(off) == pytest.approx(sp_memory_ratio(2048, 2048, 16, 4), rel=1e-12)
    assert layers(on) / layers(off) == pytest.approx(0.53, abs=0.005)
    kw = dict(tp=4, pp=1, micro_batch=1)
    a, b = (evaluate(gpt, ClusterShape(8, 8), H100, 8, sequence_parallel=sp, **kw) for sp in (False, True))
    assert b.memory["activations"] < a.memory["activations"] and b.time == a.time
    assert b.sequence_parallel and b.to_json()["sequence_parallel"] is True
    with pytest.raises(ValueError, match="sequence_parallel needs tp > 1"):
        evaluate(gpt, ClusterShape(8, 8), H100, 8, tp=1, pp=1, micro_batch=1, sequence_parallel=True)


def test_auto_takes_sp_for_a_moe_only_where_it_would_not_fit_without():
    cluster = ClusterShape(8, 8)
    plans = plan(LONG, cluster, H100, 8)
    with_sp = [p for p in plans if p.sequence_parallel]
    assert with_sp and all(p.tp > 1 for p in with_sp)
    for p in with_sp[:5]:
        without = evaluate(LONG, cluster, H100, 8, tp=p.tp, pp=p.pp, micro_batch=p.micro_batch,
                           zero_stage=p.zero_stage, recompute=p.recompute, schedule=p.schedule,
                           virtual_stages=p.virtual_stages, expert_parallel_size=p.expert_parallel_size)
        assert not without.fits
    assert not any(p.sequence_parallel for p in plan(LONG, cluster, H100, 8, sequence_parallel=False))


def test_dense_models_get_neither_ep_nor_sp_unless_asked():
    gpt = ModelShape(24, 2048, 16, 2048, 50257)
    plans = plan(gpt, ClusterShape(8, 8), H100, 64)
    assert all(p.expert_parallel_size == 1 and not p.sequence_parallel for p in plans)
    assert [p.to_json() for p in plans] == [p.to_json() for p in
                                            plan(gpt, ClusterShape(8, 8), H100, 64, sequence_parallel=False)]
    assert "ep_comm" not in plans[0].time and plans[0].to_json()["expert_parallel_size"] == 1
    asked = plan(gpt, ClusterShape(8, 8), H100, 64, sequence_parallel=True)
    assert all(p.sequence_parallel == (p.tp > 1) for p in asked)
    with pytest.raises(ValueError, match="expert_parallel_size=2"):
        evaluate(gpt, ClusterShape(8, 8), H100, 64, tp=1, pp=1, micro_batch=1, expert_parallel_size=2)
    with pytest.raises(ValueError, match="divide dp"):
        evaluate(MIXTRAL, ClusterShape(8, 8), H100, 64, tp=1, pp=1, micro_batch=1, zero_stage=3,
                 expert_parallel_size=3)


def _moe_doc(**parallel) -> dict:
    """34B parameters, nearly all in experts: on 16 H100s, sharding them with ZeRO (or
    splitting them with TP, which 4 heads limit to 4) is 3x slower than splitting the
    experts over the replicas."""
    model = {"type": "moe", "n_layers": 3, "n_heads": 4, "d_model": 4096, "seq_len": 4096,
             "vocab_size": 32000, "d_ff": 14336, "n_experts": 64, "top_k": 2}
    return {"model": model, "parallel": {"auto": True, "gpus": 16, "gpu": "h100-80gb",
                                         "global_batch": 64, **parallel}}


def test_parallel_auto_writes_the_expert_parallel_size_and_its_all_to_all():
    out, rec = autoplan.resolve(_moe_doc(), None)
    spec = validate_spec(out)
    p = spec.parallel
    assert p.expert_parallel_size == rec["expert_parallel_size"] > 1
    assert p.data_parallel_size % p.expert_parallel_size == 0 and p.zero_stage != 1
    assert "all_to_all" in spec.permission.collectives
    assert rec["sequence_parallel"] is p.sequence_parallel and rec["all_to_all_s"] > 0
    # Asked for an EP size, the planner keeps to it.
    out, rec = autoplan.resolve(_moe_doc(expert_parallel_size=4), None)
    assert rec["expert_parallel_size"] == validate_spec(out).parallel.expert_parallel_size == 4
    assert "all_to_all" in validate_spec(out).permission.collectives


def test_kc_plan_shows_ep_and_sp(tmp_path):
    path = tmp_path / "moe.yaml"
    path.write_text(json.dumps({"model": _moe_doc()["model"]}))
    out = CliRunner().invoke(main.app, ["plan", "--model", str(path), "--gpus", "16",
                                        "--global-batch", "64", "--json", "--top", "3"])
    assert out.exit_code == 0, out.output
    plans = json.loads(out.output)
    assert plans and all({"expert_parallel_size", "sequence_parallel", "all_to_all_s",
                          "expert_weights_gb_per_gpu"} <= set(p) for p in plans)
    assert plans[0]["expert_parallel_size"] > 1 and plans[0]["all_to_all_s"] > 0
    text = CliRunner().invoke(main.app, ["plan", "--model", str(path), "--gpus", "16",
                                         "--global-batch", "64", "--top", "3"])
    assert text.exit_code == 0 and "64 experts top-2" in text.output and " ep=" in text.output
