"""The planner prices the collectives the engine issues: NCCL's latency and bus bandwidth
(planning/comm.py), FSDP2's per-block traffic and overlap, DDP's buckets, ZeRO-1's
broadcasts, and HSDP (cost.py)."""

from __future__ import annotations

import pytest

from kuangchao.platform.cluster.hardware import calibrated, get_accelerator
from kuangchao.platform.planning import comm
from kuangchao.platform.planning.cost import CostModel
from kuangchao.platform.planning.planner import describe, evaluate, plan
from kuangchao.platform.planning.shapes import ClusterShape, ModelShape

A100 = get_accelerator("a100-80gb")
H100 = get_accelerator("h100-80gb")
GPT3_175B = ModelShape(96, 12288, 96, 2048, 51200)
GPT_1B = ModelShape(24, 2048, 16, 2048, 51200)
BIG = ModelShape(32, 4096, 32, 1024, 50257)


def test_ring_latency_is_one_hop_per_step_with_network_hops_where_it_leaves_a_node():
    acc = A100
    # 1536 ranks on 192 nodes: 1535 steps, 191 of them across the network (NCCL's model).
    want = acc.base_latency_s + (1535 - 191) * acc.hop_latency_s + 191 * acc.net_hop_latency_s
    assert comm.latency("all_gather", 1536, 8, acc) == pytest.approx(want)
    assert comm.latency("reduce_scatter", 768, 8, acc) < comm.latency("reduce_scatter", 1536, 8, acc)
    inside = comm.latency("all_gather", 8, 8, acc)
    assert inside == pytest.approx(acc.base_latency_s + 7 * acc.hop_latency_s)
    # All-reduce: NCCL's tree where it is cheaper (log2 of the nodes across the network).
    assert comm.latency("all_reduce", 1024, 8, acc) < 2 * comm.latency("all_gather", 1024, 8, acc) / 4


def test_a_ring_gets_one_share_of_the_nodes_network_per_rank_unless_rings_aggregate_nics():
    acc = calibrated(A100, internode_bytes_per_s=6.25e9, nic_bytes_per_s=12.5e9)
    assert comm.bus_bandwidth(8, 8, acc) == acc.nvlink_bytes_per_s  # one node: NVLink
    # By default each rank's bytes cross at its own share, however many share the node.
    assert comm.bus_bandwidth(128, 8, acc) == pytest.approx(6.25e9)
    assert comm.bus_bandwidth(16, 1, acc) == pytest.approx(6.25e9)
    agg = calibrated(acc, rings_aggregate_nics=True)
    assert comm.bus_bandwidth(128, 8, agg) == pytest.approx(8 * 6.25e9)  # the node's 400 Gb/s
    assert comm.bus_bandwidth(16, 1, agg) == pytest.approx(6.25e9)  # tp = 8: a share each
    assert comm.bus_bandwidth(64, 4, agg) == pytest.approx(4 * 6.25e9)
    # A pipeline send: alone on the node it may take a whole NIC, eight at once a share each.
    alone = comm.p2p(1e8, True, 1, acc, 8)
    crowded = comm.p2p(1e8, True, 8, acc, 8)
    assert crowded > alone and alone == pytest.approx(
        acc.base_latency_s + acc.net_hop_latency_s + 1e8 / 12.5e9)


def test_zero3_gathers_each_layer_twice_per_micro_batch_and_reduce_scatters_once_per_step():
    ctx = CostModel(GPT_1B, ClusterShape(64, 8), A100, 256)
    cluster = ClusterShape(64, 8)
    lp = GPT_1B.layer_params
    ag = comm.collective("all_gather", 2 * lp, 64, 8, A100)
    rs = comm.collective("reduce_scatter", 4 * lp, 64, 8, A100)
    for m in (1, 4):
        total = ctx.times(64, 1, 1, 4 // m, m, 3, False, "none", 1)[4]
        other = GPT_1B.params - GPT_1B.n_layers * lp
        root = (comm.collective("all_gather", 2 * other, 64, 8, A100) * m
                + comm.collective("reduce_scatter", 4 * other, 64, 8, A100))
        raw = m * GPT_1B.n_layers * 2 * ag + GPT_1B.n_layers * rs + root
        assert raw <= total <= 1.1 * raw + 1e-12, m  # plus CONTENTION on what is hidden
    z2 = evaluate(GPT_1B, cluster, A100, 256, tp=1, pp=1, micro_batch=1, zero_stage=2)
    z3 = evaluate(GPT_1B, cluster, A100, 256, tp=1, pp=1, micro_batch=1, zero_stage=3)
    assert z3.time["dp_comm"] > z2.time["dp_comm"]  # ZeRO-3 gathers again in backward


def test_fsdp_hides_a_layers_gather_behind_the_previous_layers_compute_only_while_it_fits():
    # Compute-bound (rings over the node's NICs, as on [Z23]'s cluster): only the first
    # gather and the last reduce-scatter show.
    fast = evaluate(GPT3_175B, ClusterShape(512, 8), calibrated(A100, rings_aggregate_nics=True),
                    1024, tp=1, pp=1, micro_batch=2, zero_stage=3, recompute=True)
    assert fast.time["dp_exposed"] < 0.1 * fast.time["dp_comm"] + 0.1 * fast.time["compute"]
    # A slow network: each layer's collectives outlast its compute and the excess shows.
    slow_acc = calibrated(A100, internode_bytes_per_s=1e9)
    slow = evaluate(GPT3_175B, ClusterShape(512, 8), slow_acc, 1024, tp=1, pp=1, micro_batch=2,
                    zero_stage=3, recompute=True)
    assert slow.time["dp_exposed"] > 0.8 * (slow.time["dp_comm"] - slow.time["compute"])
    assert slow.predicted_step_s >= slow.time["dp_comm"]


def test_under_a_pipeline_fsdp_reduce_scatters_wait_for_the_end_of_the_step():
    kw = {"tp": 8, "pp": 4, "micro_batch": 1, "zero_stage": 2, "schedule": "1f1b"}
    z2 = evaluate(BIG, ClusterShape(64, 8), H100, 64, **kw)
    ctx = CostModel(BIG, ClusterShape(64, 8), H100, 64)
    rs = comm.collective("reduce_scatter", 4 * BIG.layer_params / 8, 2, 1, H100)
    assert z2.time["dp_exposed"] >= BIG.n_layers // 4 * rs
    # Sends carry bf16 activations under FSDP2, fp32 (the autocast residual stream) otherwise.
    z0 = evaluate(BIG, ClusterShape(64, 8), H100, 64, **{**kw, "zero_stage": 0})
    assert z0.time["pp_p2p"] > 1.5 * z2.time["pp_p2p"]
    assert ctx.per_node(32, 2) == 1


def test_ddp_exposes_at_least_its_last_bucket_and_whatever_outlasts_the_backward():
    model = ModelShape(12, 768, 12, 1024, 50257)
    one_node = evaluate(model, ClusterShape(8, 8), A100, 64, tp=1, pp=1, micro_batch=8)
    last = comm.allreduce_costs(4 * (50257 + 1024) * 768, 8, 8, A100)[0]
    assert one_node.time["dp_exposed"] >= last
    assert one_node.time["dp_exposed"] < one_node.time["dp_comm"]
    slow = evaluate(model, ClusterShape(64, 8), calibrated(A100, internode_bytes_per_s=1e8), 512,
                    tp=1, pp=1, micro_batch=8)
    backward = (slow.time["compute"]) * 2 / 3
    assert slow.time["dp_exposed"] >= slow.time["dp_comm"] - backward


def test_zero1_pays_a_broadcast_per_parameter_tensor_after_the_step():
    cluster = ClusterShape(1024, 8)
    z0 = evaluate(GPT_1B, cluster, A100, 1024, tp=1, pp=1, micro_batch=1, zero_stage=0)
    z1 = evaluate(GPT_1B, cluster, A100, 1024, tp=1, pp=1, micro_batch=1, zero_stage=1)
    tensors = 16 * GPT_1B.n_layers + 4
    extra = z1.time["dp_exposed"] - z0.time["dp_exposed"]
    assert extra >= tensors * comm.latency("broadcast", 1024, 8, A100)
    assert z1.memory_bytes < z0.memory_bytes  # Adam's moments sharded over dp


def test_fsdp_with_accumulation_keeps_the_unsharded_gradients():
    cluster = ClusterShape(64, 8)
    one = evaluate(GPT_1B, cluster, A100, 64, tp=1, pp=1, micro_batch=1, zero_stage=3)
    accum = evaluate(GPT_1B, cluster, A100, 256, tp=1, pp=1, micro_batch=1, zero_stage=3)
    assert one.memory["grad_accumulation"] == 0
    assert accum.memory["grad_accumulation"] == pytest.approx(4 * GPT_1B.params * 63 / 64 / 1e9)


def test_hsdp_shards_within_its_group_and_all_reduces_across_groups():
    cluster = ClusterShape(32, 8)
    full = evaluate(BIG, cluster, A100, 1024, tp=1, pp=1, micro_batch=8, zero_stage=3)
    hsdp = evaluate(BIG, cluster, A100, 1024, tp=1, pp=1, micro_batch=8, zero_stage=3,
                    shard_group_size=8)
    assert hsdp.shard_group_size == 8 and full.shard_group_size is None
    assert hsdp.memory["weights"] == pytest.approx(4 * BIG.params / 8 / 1e9)
    assert full.memory["weights"] == pytest.approx(4 * BIG.params / 32 / 1e9)
    # With accumulation FSDP gathers across nodes every micro-batch; HSDP over NVLink.
    assert hsdp.predicted_step_s < full.predicted_step_s
    assert "hsdp=8" in describe(hsdp) and hsdp.to_json()["shard_group_size"] == 8
    same = evaluate(BIG, cluster, A100, 1024, tp=1, pp=1, micro_batch=8, zero_stage=3,
                    shard_group_size=32)
    assert same.shard_group_size is None  # a group of all of dp is plain FSDP
    for bad in ({"shard_group_size": 3}, {"shard_group_size": 8, "zero_stage": 1}):
        with pytest.raises(ValueError, match="shard_group_size"):
            evaluate(BIG, cluster, A100, 1024, tp=1, pp=1, micro_batch=8,
                     **{"zero_stage": 3, **bad})


def test_the_planner_chooses_hsdp_where_it_is_fastest():
    best = plan(BIG, ClusterShape(32, 8), A100, 1024, top=1)[0]
    assert best.zero_stage >= 2 and best.shard_group_size == 8, describe(best)
    everything = plan(BIG, ClusterShape(32, 8), A100, 1024)
    sizes = {p.shard_group_size for p in everything}
    assert {None, 8} <= sizes and all(s is None or (32 // p.tp // p.pp) % s == 0
                                      for p in everything for s in [p.shard_group_size])
    assert all(p.shard_group_size is None for p in everything if p.zero_stage < 2)
