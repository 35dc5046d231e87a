"""Plans across GPU pools: `kc plan --gpus 16xh100-80gb,16xa100-80gb`, mixes of types
with the batch split by speed, and `parallel: auto` on a cluster of two types."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kuangchao.api.cli import main
from kuangchao.api.cli.render import plan_line
from kuangchao.platform.cluster.hardware import CATALOG
from kuangchao.platform.cluster.topology import ClusterTopology, NodeInfo
from kuangchao.platform.errors import SpecError
from kuangchao.platform.planning import autoplan
from kuangchao.platform.planning.cost import CostModel
from kuangchao.platform.planning.mix import apportion, plan_mix
from kuangchao.platform.planning.planner import plan
from kuangchao.platform.planning.pools import Pool, parse_pools, plan_pools, speed
from kuangchao.platform.planning.shapes import ClusterShape, ModelShape
from kuangchao.platform.spec.jobspec import validate_spec

H100, A100, A100_40 = CATALOG["h100-80gb"], CATALOG["a100-80gb"], CATALOG["a100-40gb"]
# GPT-3 XL (1.3B): fits one 80 GB GPU with data parallelism alone.
XL = ModelShape(24, 2048, 16, 2048, 50257)
XL_SPEC = {"type": "gpt", "n_layers": 24, "n_heads": 16, "d_model": 2048, "seq_len": 2048,
           "vocab_size": 50257}


def budget(acc) -> float:
    return 0.9 * acc.hbm_bytes / 1e9


# -- pools on the command line ------------------------------------------------------------

def test_parse_pools_reads_count_x_type_in_order():
    pools = parse_pools("16xh100-80gb, 8XA100-80GB")
    assert [(p.acc.name, p.gpus, p.shape.node_size) for p in pools] == [
        ("h100-80gb", 16, 8), ("a100-80gb", 8, 8)]
    assert parse_pools("4xh100-80gb", gpus_per_node=4)[0].shape.nodes == 1


@pytest.mark.parametrize("text, says", [
    ("16xv100", "unknown GPU type 'v100'; known: a100-40gb"),
    ("16h100-80gb", "is not a pool; write COUNTxTYPE pools joined by commas, e.g. 16xh100-80gb"),
    ("16xh100-80gb,,8xa100-80gb", "'' is not a pool"),
    ("0xh100-80gb", "a pool needs at least one GPU"),
    ("8xh100-80gb,8xh100-80gb", "named twice; give each type once with its whole count (e.g. 16xh100-80gb)"),
    ("12xh100-80gb", "not a whole number of 8-GPU nodes"),
])
def test_parse_pools_refuses_bad_input_saying_what_to_write(text, says):
    with pytest.raises(ValueError) as err:
        parse_pools(text)
    assert says in str(err.value)


def kc_plan(*args: str):
    return CliRunner().invoke(main.app, ["plan", *args])


@pytest.fixture
def xl_file(tmp_path):
    path = tmp_path / "xl.yaml"
    path.write_text(json.dumps({"model": XL_SPEC}))
    return str(path)


@pytest.mark.parametrize("gpus, extra, says", [
    ("16xh200", (), "unknown GPU type"),
    ("sixteen", (), "write COUNTxTYPE"),
    ("0", (), "give at least 1 GPU"),
    ("16xh100-80gb", ("--gpu", "a100-80gb"), "drop --gpu a100-80gb"),
    ("16", ("--gpu", "v100"), "known: a100-40gb"),
])
def test_kc_plan_exits_2_on_bad_gpus(xl_file, gpus, extra, says):
    out = kc_plan("--model", xl_file, "--gpus", gpus, *extra)
    assert out.exit_code == 2 and says in out.output, out.output
    assert "Traceback" not in out.output


def test_kc_plan_one_typed_pool_prints_as_the_plain_count(xl_file):
    typed = kc_plan("--model", xl_file, "--gpus", "8xa100-80gb", "--top", "3")
    plain = kc_plan("--model", xl_file, "--gpus", "8", "--gpu", "a100-80gb", "--top", "3")
    assert typed.exit_code == plain.exit_code == 0
    assert typed.output == plain.output and "on 8 x a100-80gb (8 per node)" in plain.output
    assert "balanced" not in plain.output


def test_kc_plan_across_pools_prints_pools_shares_and_both_predictions(xl_file):
    out = kc_plan("--model", xl_file, "--gpus", "16xh100-80gb,16xa100-80gb", "--global-batch", "512",
                  "--top", "2")
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert "on 16 x h100-80gb + 16 x a100-80gb, alone or mixed, global batch 512" in lines[0]
    assert lines[1].startswith("  1. dp=32 ")  # the mix of all 32 GPUs wins
    assert "balanced" in lines[2] and " vs even " in lines[2]
    assert "h100-80gb 75% (dp=16 x3 micro-batches = 384 seq" in lines[2]
    assert lines[-1].startswith("best on one pool: 16 x h100-80gb ")
    as_json = kc_plan("--model", xl_file, "--gpus", "16xh100-80gb,16xa100-80gb", "--global-batch",
                      "512", "--top", "2", "--json")
    first = json.loads(as_json.output)[0]
    assert [p["gpu"] for p in first["pools"]] == ["h100-80gb", "a100-80gb"]
    assert sum(p["sequences"] for p in first["pools"]) == 512
    assert first["balanced_step_s"] == first["predicted_step_s"] < first["even_step_s"]


# -- the mix --------------------------------------------------------------------------------

def test_apportion_gives_each_replica_one_then_follows_speed():
    assert apportion(100, (1, 1), (2.0, 1.0)) in {(67, 33), (66, 34)}
    assert apportion(4, (2, 2), (10.0, 1.0)) == (2, 2)  # at least one each
    with pytest.raises(ValueError, match="cannot give each of 4 replicas one"):
        apportion(3, (2, 2), (1.0, 1.0))


def test_a_mix_of_equal_pools_chooses_like_one_pool_twice_the_size():
    mixed = plan_pools(XL, [Pool(H100, 16), Pool(H100, 16)], 512, top=3)
    whole = plan(XL, ClusterShape(32), H100, 512, top=3)
    for m, w in zip(mixed, whole, strict=True):
        assert m.mixed and [s.sequences for s in m.shares] == [256, 256]
        assert (m.plan.dp, m.plan.tp, m.plan.pp, m.plan.micro_batch, m.plan.zero_stage,
                m.plan.shard_group_size) == (w.dp, w.tp, w.pp, w.micro_batch, w.zero_stage,
                                             w.shard_group_size)
        assert m.plan.predicted_step_s == pytest.approx(w.predicted_step_s, rel=1e-9)
        assert m.even_step_s == pytest.approx(m.balanced_step_s, rel=1e-12)
        assert m.plan.memory_gb_per_gpu == pytest.approx(w.memory_gb_per_gpu, rel=1e-12)


def test_h100_and_a100_balanced_beats_even_and_shares_follow_the_speed_ratio():
    pools = [Pool(H100, 16), Pool(A100, 16)]
    gb = 4096
    plans = plan_pools(pools=pools, model=XL, global_batch=gb, top=5)
    assert plans and all(p.mixed for p in plans)
    ideal = speed(H100) / (speed(H100) + speed(A100))  # the same GPU count of each
    assert 0.72 < ideal < 0.73
    for p in plans:
        h, a = p.shares
        assert p.plan.predicted_step_s == p.balanced_step_s < p.even_step_s
        # Within one micro-batch per replica of the ideal split.
        assert abs(h.sequences / gb - ideal) <= h.dp * p.plan.micro_batch / gb
        assert h.sequences + a.sequences == gb
        assert p.plan.dp == h.dp + a.dp and p.plan.num_microbatches * p.plan.dp * p.plan.micro_batch == gb
    best = plans[0]
    # The even split is the A100s doing half the batch at their speed: about 2.6x slower.
    assert best.even_step_s / best.balanced_step_s > 1.5
    alone = [plan(XL, p.shape, p.acc, gb, top=1)[0].predicted_step_s for p in pools]
    assert best.plan.predicted_step_s < min(alone)


def test_a_mix_is_not_offered_where_the_smaller_memory_type_cannot_hold_it():
    # 2.7B: Adam state alone (16 bytes a parameter) fits 80 GB with plain data
    # parallelism, not 40 GB.
    model = ModelShape.from_param_count(2.7e9, 2048, 50257)
    pools = [Pool(H100, 8), Pool(A100_40, 8)]
    plain = lambda p: (p.tp, p.pp, p.zero_stage) == (1, 1, 0)  # noqa: E731
    assert any(plain(p) for p in plan(model, pools[0].shape, H100, 64))
    mixes = plan_mix(model, pools, 64)
    assert mixes and not any(plain(p.plan) for p in mixes)
    for p in mixes:
        for s in p.shares:
            assert s.memory_gb_per_gpu <= budget(s.pool.acc) + 1e-9
    # Nothing fits a 40 GB GPU at all: no plan, mixed or alone, is offered.
    big = ModelShape.from_param_count(175e9, 2048, 51200)
    assert plan_mix(big, [Pool(H100, 8), Pool(A100_40, 8)], 64) == []


def test_without_mixing_only_single_pools_are_planned():
    plans = plan_pools(XL, [Pool(H100, 16), Pool(A100, 16)], 512, mix=False, top=50)
    assert plans and not any(p.mixed for p in plans)
    assert plans[0].shares[0].pool.acc is H100


def test_replica_compute_is_the_step_compute_of_one_replica():
    ctx = CostModel(XL, ClusterShape(16), H100, 4 * 4 * 2)  # dp x micro-batch x micro-batches
    assert ctx.replica_compute(2, 2, 4, 2, True) == pytest.approx(
        ctx.times(4, 2, 2, 4, 2, 0, True, "1f1b", 1)[0], rel=1e-12)


# -- parallel: auto -------------------------------------------------------------------------

def typed(*types: str) -> ClusterTopology:
    return ClusterTopology("mixed", tuple(
        NodeInfo(f"node-{i}", 8, (tuple(range(8)),), "leaf-0", gpu_type=t) for i, t in enumerate(types)))


MIXED = typed("h100-80gb", "h100-80gb", "a100-80gb", "a100-80gb")


def auto(heterogeneous: bool, **parallel) -> dict:
    return {"model": dict(XL_SPEC), "parallel": {"auto": True, "global_batch": 512, **parallel},
            "resources": {"gpu_types": ["h100-80gb", "a100-80gb"], "heterogeneous": heterogeneous}}


def test_auto_with_heterogeneous_true_may_mix_the_pools():
    out, rec = autoplan.resolve(auto(True), MIXED)
    spec = validate_spec(out)
    assert spec.parallel.world_size == 32 and not spec.parallel.auto
    assert rec["gpu"] == "h100-80gb+a100-80gb" and rec["gpus"] == 32 and rec["rank"] == 1
    assert [(p["gpu"], p["gpus"]) for p in rec["pools"]] == [("h100-80gb", 16), ("a100-80gb", 16)]
    assert rec["pools"][0]["share"] > rec["pools"][1]["share"]
    assert rec["predicted_step_s"] == rec["balanced_step_s"] < rec["even_step_s"]
    assert out["resources"]["heterogeneous"] is True  # the rest of the spec is the user's
    assert out["resources"]["gpu_types"] == ["h100-80gb", "a100-80gb"]
    line = plan_line(rec, None)
    assert "16 x h100-80gb (75% of the batch) + 16 x a100-80gb (25% of the batch)" in line
    assert "(balanced " in line and " vs even " in line


def test_auto_with_heterogeneous_false_takes_the_best_single_pool():
    out, rec = autoplan.resolve(auto(False), MIXED)
    assert validate_spec(out).parallel.world_size == 16
    assert rec["gpu"] == "h100-80gb" and len(rec["pools"]) == 1 and rec["pools"][0]["share"] == 1.0
    # Sized for the H100 pool, so placed there: the scheduler may not pick the A100 pool.
    assert validate_spec(out).resources.gpu_types == ["h100-80gb"]
    assert rec["balanced_step_s"] == rec["even_step_s"] == rec["predicted_step_s"]
    assert "balanced" not in plan_line(rec, None) and "on 16 x h100-80gb," in plan_line(rec, None)


def test_auto_with_a_rank_count_takes_it_alone_or_in_whole_nodes_of_each_type():
    _, rec = autoplan.resolve(auto(True, gpus=16), typed("h100-80gb", "a100-80gb", "a100-80gb"))
    assert rec["gpus"] == 16
    assert rec["gpu"] == "h100-80gb+a100-80gb"  # 8 of each beats 16 A100s; it has 8 H100s only
    with pytest.raises(SpecError) as err:
        autoplan.resolve(auto(False, gpus=24), MIXED)
    assert err.value.errors[0][0] == "parallel.gpus" and "heterogeneous: true" in err.value.errors[0][1]


def test_auto_with_even_balance_ranks_by_the_even_split():
    doc = auto(True)
    doc["resources"]["balance"] = "even"
    _, rec = autoplan.resolve(doc, MIXED)
    assert rec["predicted_step_s"] == rec["even_step_s"]
    assert [p["share"] for p in rec["pools"]] in ([0.5, 0.5], [1.0])


def test_auto_without_a_node_of_the_types_needs_a_rank_count():
    with pytest.raises(SpecError) as err:
        autoplan.resolve(auto(True), typed("h200-141gb"))
    assert err.value.errors[0][0] == "parallel.gpus"
    _, rec = autoplan.resolve(auto(True, gpus=8), None)
    assert rec["gpu"] == "a100-80gb" and rec["gpus"] == 8  # the type with less memory, to be safe


def test_splits_take_whole_nodes_the_fastest_type_first():
    from kuangchao.platform.planning.autopools import splits

    pools = parse_pools("32xa100-80gb,16xh100-80gb")
    got = [[p.label for p in s] for s in splits(pools, 32)]
    assert got == [["16 x a100-80gb", "16 x h100-80gb"], ["24 x a100-80gb", "8 x h100-80gb"]]
    assert list(splits(pools, 12)) == []  # not whole 8-GPU nodes
