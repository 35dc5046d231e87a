"""The auto-parallel planner: hard constraints on every plan, and the cost model's directions."""

import dataclasses
import json

import pytest

from kuangchao.platform.cluster.hardware import CATALOG, GiB, calibrated, get_accelerator
from kuangchao.platform.planning.cost import allreduce_costs, bubble_fraction
from kuangchao.platform.planning.planner import describe, evaluate, plan
from kuangchao.platform.planning.shapes import ClusterShape, ModelShape, Plan

CONTRACT = ["dp", "tp", "pp", "micro_batch", "zero_stage", "recompute", "schedule",
            "memory_gb_per_gpu", "predicted_step_s", "predicted_tflops_per_gpu"]
GPT3_175B = ModelShape.from_param_count(175e9, 2048, 51200)
GPT2_SMALL = ModelShape.from_param_count(124e6, 1024, 50257)
# 48 heads and 96 layers divide by most tp / pp values, so the search space is wide.
MID = ModelShape(n_layers=48, d_model=6144, n_heads=48, seq_len=2048, vocab_size=51200)
H100, A100_40, A100_80 = (get_accelerator(n) for n in ("h100-80gb", "a100-40gb", "a100-80gb"))

CASES = [
    (GPT3_175B, ClusterShape(4096, 8), H100, 1536),
    (GPT3_175B, ClusterShape(512, 8), get_accelerator("h200-141gb"), 512),
    (MID, ClusterShape(64, 8), A100_40, 512),
    (MID, ClusterShape(48, 4), A100_80, 96),
    (GPT2_SMALL, ClusterShape(8, 8), A100_80, 256),
    (GPT2_SMALL, ClusterShape(4, 8), A100_40, 64),  # a partial node
    (ModelShape(24, 2048, 16, 1024, 50257), ClusterShape(12, 6), A100_40, 96),
]


@pytest.fixture(scope="module", params=range(len(CASES)))
def case(request):
    model, cluster, acc, batch = CASES[request.param]
    plans = plan(model, cluster, acc, batch)
    assert plans, "every case here has at least one layout that fits"
    return model, cluster, acc, batch, plans


def test_no_plan_exceeds_the_memory_headroom(case):
    _, _, acc, _, plans = case
    for p in plans:
        assert p.fits
        assert p.memory_bytes <= 0.9 * acc.hbm_bytes
        assert p.memory_gb_per_gpu * 1e9 == pytest.approx(p.memory_bytes, rel=1e-6)
        assert sum(p.memory.values()) * 1e9 == pytest.approx(p.memory_bytes, rel=1e-6)


def test_a_tighter_headroom_only_removes_plans():
    model, cluster, acc, batch = CASES[2][:4]
    loose = plan(model, cluster, acc, batch)
    tight = plan(model, cluster, acc, batch, memory_headroom=0.5)
    assert 0 < len(tight) < len(loose)
    assert all(p.memory_bytes <= 0.5 * acc.hbm_bytes for p in tight)


def test_tensor_parallel_never_crosses_a_node(case):
    model, cluster, _, _, plans = case
    for p in plans:
        assert p.tp <= cluster.gpus_per_node and cluster.gpus_per_node % p.tp == 0
        assert model.n_heads % p.tp == 0 and model.d_model % p.tp == 0


def test_every_plan_uses_all_gpus_and_splits_the_batch_exactly(case):
    model, cluster, _, batch, plans = case
    for p in plans:
        assert p.dp * p.tp * p.pp == cluster.gpus
        assert batch % (p.dp * p.micro_batch) == 0
        assert p.dp * p.micro_batch * p.num_microbatches == batch
        assert model.n_layers % p.pp == 0
        assert (p.schedule == "none") == (p.pp == 1)
        if p.schedule == "interleaved_1f1b":
            assert p.virtual_stages >= 2 and (model.n_layers // p.pp) % p.virtual_stages == 0
            assert p.num_microbatches % p.pp == 0
        else:
            assert p.virtual_stages == 1
        if p.dp == 1:
            assert p.zero_stage == 0  # ZeRO over one rank is no ZeRO; not listed four times


def test_plans_are_ranked_by_step_time(case):
    plans = case[4]
    steps = [p.predicted_step_s for p in plans]
    assert steps == sorted(steps)
    assert len(set(plans)) == len(plans)


def test_175b_on_4096_h100s_splits_the_model():
    # How fast the search runs is bench/planner.py's `planner_search_ms`, not a timed test.
    plans = plan(GPT3_175B, ClusterShape(4096, 8), H100, 1536)
    assert plans
    best = plans[0]
    assert best.tp > 1 and best.pp > 1, describe(best)
    # 175B parameters need 700 GB for bf16 weights and gradients alone: nothing unsplit fits.
    assert not [p for p in plans if p.tp * p.pp == 1]


def test_gpt3_shapes_come_from_the_paper_and_other_sizes_are_derived():
    assert (GPT3_175B.n_layers, GPT3_175B.d_model, GPT3_175B.n_heads) == (96, 12288, 96)
    assert GPT3_175B.params == pytest.approx(175e9, rel=0.01)
    assert (GPT2_SMALL.n_layers, GPT2_SMALL.d_model, GPT2_SMALL.n_heads) == (12, 768, 12)
    for n in (3e8 * 0.7, 30e9, 70e9, 1e12):
        m = ModelShape.from_param_count(n, 2048, 51200)
        assert m.params == pytest.approx(n, rel=0.15), m
        assert m.d_model % 128 == 0 and m.d_model % m.n_heads == 0
        assert m.d_model < 2048 or m.n_heads % 8 == 0, m  # tp = 8 stays possible for wide models


def test_param_count_matches_the_built_models():
    torch = pytest.importorskip("torch")
    from kuangchao.workers.models.config import ModelConfig
    from kuangchao.workers.models.factory import build_model

    torch.manual_seed(0)
    for arch, d_ff in (("gpt", None), ("gpt", 200), ("llama", None), ("llama", 96)):
        cfg = ModelConfig(type=arch, n_layers=3, n_heads=4, d_model=64, seq_len=32, vocab_size=101, d_ff=d_ff)
        built = build_model(cfg)
        distinct = {id(p): p.numel() for p in built.parameters()}
        shape = ModelShape(3, 64, 4, 32, 101, d_ff, arch)
        assert shape.params == sum(distinct.values()), (arch, d_ff)


def test_from_spec_model_reads_a_job_spec():
    from kuangchao.platform.spec.jobspec import JobSpec

    spec = JobSpec().model_dump(mode="json")
    shape = ModelShape.from_spec_model(spec)
    m = spec["model"]
    assert (shape.n_layers, shape.d_model, shape.n_heads, shape.seq_len, shape.vocab_size, shape.arch) == (
        m["n_layers"], m["d_model"], m["n_heads"], m["seq_len"], m["vocab_size"], m["type"])
    with pytest.raises(ValueError, match="n_heads"):
        ModelShape.from_spec_model({"n_layers": 2, "d_model": 64, "seq_len": 8, "vocab_size": 10})


def test_a_small_model_on_one_node_prefers_pure_data_parallelism():
    plans = plan(GPT2_SMALL, ClusterShape(8, 8), A100_80, 256)
    assert (plans[0].tp, plans[0].pp, plans[0].dp) == (1, 1, 8)
    assert {p.tp for p in plans} == {1, 2, 4}  # 12 heads: tp=8 is never a candidate
    with_tp = evaluate(GPT2_SMALL, ClusterShape(8, 8), A100_80, 256, tp=4, pp=1, micro_batch=32)
    assert with_tp.predicted_step_s > plans[0].predicted_step_s
    assert with_tp.time["tp_comm"] > 0


def test_a_model_too_big_for_the_cluster_gets_no_plan():
    assert plan(GPT3_175B, ClusterShape(8, 8), A100_40, 64) == []
    # ... and one that fits under a tighter budget does not when memory is nearly all spoken for.
    assert plan(GPT2_SMALL, ClusterShape(1, 8), calibrated(A100_40, hbm_bytes=2 * GiB), 8) == []


def test_recompute_trades_activation_memory_for_compute():
    kw = {"tp": 8, "pp": 8, "micro_batch": 1, "zero_stage": 1}
    off = evaluate(GPT3_175B, ClusterShape(4096, 8), H100, 1536, recompute=False, **kw)
    on = evaluate(GPT3_175B, ClusterShape(4096, 8), H100, 1536, recompute=True, **kw)
    assert on.memory["activations"] < off.memory["activations"] / 4
    assert on.time["compute"] > off.time["compute"] * 1.2
    assert on.time["tp_comm"] > off.time["tp_comm"]  # the extra forward repeats its all-reduces
    assert on.mfu < off.mfu  # recomputed FLOPs are not model FLOPs


def test_each_zero_stage_needs_less_memory_than_the_one_before():
    mem = [evaluate(MID, ClusterShape(64, 8), A100_80, 512, tp=4, pp=1, micro_batch=1,
                    zero_stage=z).memory_bytes for z in range(4)]
    assert mem[3] < mem[2] < mem[1] < mem[0]
    # Changed on purpose (issue 24): under a pipeline the engine's FSDP2 keeps every block
    # gathered until the step's last micro-batch (torch.distributed.pipelining turns
    # resharding after backward off), so there ZeRO-3 holds what ZeRO-2 holds.
    piped = [evaluate(MID, ClusterShape(64, 8), A100_80, 512, tp=4, pp=2, micro_batch=1,
                      zero_stage=z).memory_bytes for z in range(4)]
    assert piped[3] == piped[2] < piped[1] < piped[0]
    zero0 = evaluate(MID, ClusterShape(64, 8), A100_80, 512, tp=4, pp=2, micro_batch=1, zero_stage=0)
    zero3 = evaluate(MID, ClusterShape(64, 8), A100_80, 512, tp=4, pp=2, micro_batch=1, zero_stage=3)
    assert zero3.time["dp_comm"] > zero0.time["dp_comm"]  # ZeRO-3 pays in traffic


def test_bubble_shrinks_with_more_microbatches_and_with_interleaving():
    assert bubble_fraction("1f1b", 8, 32) < bubble_fraction("1f1b", 8, 8)
    assert bubble_fraction("1f1b", 8, 16) == pytest.approx(7 / 16)
    assert bubble_fraction("interleaved_1f1b", 8, 16, 3) == pytest.approx(bubble_fraction("1f1b", 8, 16) / 3)
    assert bubble_fraction("none", 1, 4) == 0.0
    args = (GPT3_175B, ClusterShape(4096, 8), H100, 1536)
    plain = evaluate(*args, tp=8, pp=8, micro_batch=1, zero_stage=1, schedule="1f1b")
    inter = evaluate(*args, tp=8, pp=8, micro_batch=1, zero_stage=1, schedule="interleaved_1f1b",
                     virtual_stages=4)
    fewer = evaluate(*args, tp=8, pp=8, micro_batch=2, zero_stage=1, schedule="1f1b")
    assert inter.time["bubble"] < plain.time["bubble"]
    assert inter.time["pp_p2p"] > plain.time["pp_p2p"]  # v times as many stage-to-stage sends
    assert inter.memory["activations"] > plain.memory["activations"]
    assert fewer.num_microbatches == plain.num_microbatches // 2
    assert fewer.time["bubble"] / fewer.time["compute"] > plain.time["bubble"] / plain.time["compute"]
    gpipe = evaluate(*args, tp=8, pp=8, micro_batch=1, zero_stage=1, schedule="gpipe")
    assert gpipe.memory["activations"] > plain.memory["activations"]  # all micro-batches in flight


def test_hierarchical_allreduce_wins_where_each_gpu_pays_its_own_share_not_where_rings_aggregate():
    # By default every GPU's traffic crosses the network at its own share of the node's
    # NICs (planning/comm.py), so the two-level hook, which sends 1/k of the bytes across
    # nodes, wins once a data-parallel group spans nodes with several ranks each.
    flat, hier = allreduce_costs(1e9, ranks=32, ranks_per_node=4, acc=H100)
    assert hier < flat
    spanning = evaluate(MID, ClusterShape(64, 8), H100, 512, tp=1, pp=1, micro_batch=1)
    assert spanning.dp == 64 and spanning.hierarchical_allreduce  # 8 replicas a node, 8 nodes
    # Where NCCL's rings aggregate the node's NICs, the cross-node bytes per node are the
    # same for both, and the hook's extra NVLink passes and latency make it lose.
    agg = calibrated(H100, rings_aggregate_nics=True)
    flat, hier = allreduce_costs(1e9, ranks=32, ranks_per_node=4, acc=agg)
    assert flat < hier
    assert not evaluate(MID, ClusterShape(64, 8), agg, 512, tp=1, pp=1,
                        micro_batch=1).hierarchical_allreduce
    # One replica per node: the hierarchy has nothing to reduce inside a node.
    assert allreduce_costs(1e9, 8, 1, H100)[0] == pytest.approx(allreduce_costs(1e9, 8, 1, H100)[1])
    # Inside one node both are the NVLink ring.
    inside = evaluate(GPT2_SMALL, ClusterShape(8, 8), H100, 64, tp=1, pp=1, micro_batch=1)
    assert not inside.hierarchical_allreduce and inside.time["dp_comm"] > 0
    assert allreduce_costs(1e9, 8, 8, H100)[0] == allreduce_costs(1e9, 8, 8, H100)[1]


def test_unknown_accelerator_names_the_known_ones():
    with pytest.raises(ValueError) as err:
        get_accelerator("tpu-v9")
    for name in CATALOG:
        assert name in str(err.value)
    assert get_accelerator("H100-80GB") is CATALOG["h100-80gb"]


def test_catalog_holds_the_data_sheet_numbers():
    assert set(CATALOG) == {"a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "cpu"}
    assert (A100_40.peak_flops, A100_40.hbm_bytes, A100_40.nvlink_bytes_per_s) == (312e12, 40 * GiB, 300e9)
    assert (H100.peak_flops, H100.internode_bytes_per_s) == (989e12, 50e9)
    assert CATALOG["h200-141gb"].hbm_bytes == 141e9
    cpu = calibrated(CATALOG["cpu"], peak_flops=2e11, efficiency=1.0)
    assert (cpu.peak_flops, cpu.mfu_ceiling) == (2e11, 1.0)
    assert cpu.nvlink_bytes_per_s == CATALOG["cpu"].nvlink_bytes_per_s
    with pytest.raises(ValueError, match="mfu_ceiling"):
        dataclasses.replace(H100, mfu_ceiling=1.5)


def test_to_json_keeps_the_contract():
    best = plan(MID, ClusterShape(64, 8), A100_80, 512, top=1)[0]
    out = best.to_json()
    assert list(out)[:10] == CONTRACT
    json.dumps(out)
    assert [f.name for f in dataclasses.fields(Plan)][:10] == CONTRACT
    assert out["dp"] * out["tp"] * out["pp"] == 64
    assert best.to_spec_parallel()["gradient_accumulation_steps"] == best.num_microbatches
    assert "GB/GPU" in describe(best)


def test_invalid_inputs_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="whole number"):
        ClusterShape(12, 8)
    with pytest.raises(ValueError, match="tp=16"):
        evaluate(MID, ClusterShape(64, 8), H100, 512, tp=16, pp=1, micro_batch=1)
    with pytest.raises(ValueError, match="multiple of dp"):
        evaluate(MID, ClusterShape(64, 8), H100, 100, tp=8, pp=1, micro_batch=1)
    with pytest.raises(ValueError, match="unknown schedule"):
        plan(MID, ClusterShape(64, 8), H100, 512, schedules=("zb-v",))
    assert plan(MID, ClusterShape(64, 8), H100, 512, top=3, zero_stages=(1,))[0].zero_stage == 1


# A tiny Llama config.json as a Hugging Face folder holds it: grouped-query attention
# (8 query heads, 2 key/value heads), SwiGLU of width 512, an untied head.
HF_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 4,
            "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 256,
            "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 512,
            "tie_word_embeddings": False}


def test_an_hf_config_gives_the_shape_and_the_parameter_count_from_its_architecture():
    shape = ModelShape.from_hf_config(HF_LLAMA, 128)
    assert (shape.n_layers, shape.n_heads, shape.kv_heads, shape.d_model, shape.ffn,
            shape.vocab_size, shape.seq_len, shape.arch, shape.tied) == (
        4, 8, 2, 256, 512, 1000, 128, "llama", False)
    h, kv = 256, 256 // 8 * 2
    layer = 2 * h * h + 2 * h * kv + 3 * h * 512 + 2 * h  # q, o; k, v; gate, up, down; 2 norms
    assert shape.params == 4 * layer + 1000 * h + h + 1000 * h  # embeddings, final norm, head
    tied = ModelShape.from_hf_config({**HF_LLAMA, "tie_word_embeddings": True}, 128)
    assert shape.params - tied.params == 1000 * h
    # seq_len: given, else 2048 capped by the model's max_position_embeddings
    assert ModelShape.from_hf_config(HF_LLAMA).seq_len == 512
    assert ModelShape.from_hf_config({**HF_LLAMA, "max_position_embeddings": 8192}).seq_len == 2048
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelShape.from_hf_config({k: v for k, v in HF_LLAMA.items() if k != "num_hidden_layers"})


def test_the_built_in_shapes_keep_their_counts_without_kv_heads():
    for arch in ("gpt", "llama"):
        plain = ModelShape(3, 64, 4, 32, 101, None, arch)
        same = ModelShape(3, 64, 4, 32, 101, None, arch, n_kv_heads=4, head_dim=None)
        assert plain.params == same.params and plain.kv_dim == plain.d_model
        assert plain.flops_per_token(False) == same.flops_per_token(False)


def test_hf_param_count_matches_transformers():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    for cfg in (HF_LLAMA, {**HF_LLAMA, "tie_word_embeddings": True}):
        built = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
        assert ModelShape.from_hf_config(cfg).params == sum(p.numel() for p in built.parameters())
    gpt2 = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=100, n_positions=64)
    built = transformers.GPT2LMHeadModel(gpt2)
    shape = ModelShape.from_hf_config(json.loads(gpt2.to_json_string()), 64)
    assert shape.arch == "gpt" and shape.tied
    assert shape.params == sum(p.numel() for p in built.parameters())


def test_tensor_parallelism_divides_the_key_value_heads_too():
    shape = ModelShape.from_hf_config(HF_LLAMA, 128)
    plans = plan(shape, ClusterShape(8, 8), A100_80, 64)
    assert plans and {p.tp for p in plans} <= {1, 2}  # 2 key/value heads: no tp=4 or tp=8
    with pytest.raises(ValueError, match="key/value heads"):
        evaluate(shape, ClusterShape(8, 8), A100_80, 64, tp=4, pp=1, micro_batch=1)
    with pytest.raises(ValueError, match="key/value heads"):
        ModelShape(2, 64, 4, 32, 100, n_kv_heads=3)
