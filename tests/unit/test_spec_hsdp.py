"""HSDP (`parallel.shard_group_size`): the layouts the spec refuses, how an elastic job
resizes with sharding groups, and where each rank's groups are
(workers/parallel/layout.py, summary.py). tests/layouts/test_layouts.py trains it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kuangchao.platform.errors import SpecError
from kuangchao.platform.spec.jobspec import validate_spec
from kuangchao.platform.spec.parallel import ParallelSection, trainer_collectives
from kuangchao.workers.parallel.layout import Layout
from kuangchao.workers.parallel.summary import describe

MODEL = {"n_layers": 4, "n_heads": 4, "d_model": 32}
FIELD = "parallel.shard_group_size"


def _errors(parallel: dict, **rest) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        validate_spec({"model": MODEL, "parallel": parallel, **rest})
    return dict(info.value.errors)


def _spec(parallel: dict, **rest):
    return validate_spec({"model": MODEL, "parallel": parallel, **rest})


@pytest.mark.parametrize("parallel, words", [
    ({"data_parallel_size": 4, "shard_group_size": 2}, "set zero_stage: 2 or 3"),
    ({"data_parallel_size": 4, "zero_stage": 1, "shard_group_size": 2}, "set zero_stage: 2 or 3"),
    ({"data_parallel_size": 4, "zero_stage": 3, "shard_group_size": 3},
     "3 does not divide data_parallel_size (4)"),
    ({"data_parallel_size": 2, "zero_stage": 3, "shard_group_size": 4},
     "4 does not divide data_parallel_size (2)"),
    ({"data_parallel_size": 4, "zero_stage": 3, "shard_group_size": 1}, "use zero_stage: 0 (DDP)"),
    ({"zero_stage": 3, "shard_group_size": 1}, "shards nothing"),
    ({"auto": True, "shard_group_size": 2}, "chosen by the planner with parallel.auto"),
])
def test_layouts_hsdp_cannot_run_are_refused_with_the_field(parallel: dict, words: str):
    errs = _errors(parallel)
    assert words in errs[FIELD]


def test_a_custom_entrypoint_gets_the_same_rules_prepare_model_wires_them():
    errs = _errors({"data_parallel_size": 4, "zero_stage": 3, "shard_group_size": 3},
                   entrypoint="pkg.mod:train")
    assert "does not divide" in errs[FIELD]


@pytest.mark.parametrize("extra", [
    {},
    {"zero_stage": 2, "gradient_accumulation_steps": 2, "recompute": True},
    {"offload": True, "precision": "bf16"},
    {"tensor_parallel_size": 2},
    {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 2},
])
def test_hsdp_runs_with_what_fsdp_runs_with(extra: dict):
    spec = _spec({"data_parallel_size": 4, "zero_stage": 3, "shard_group_size": 2, **extra})
    assert spec.parallel.shard_group_size == 2
    # FSDP2's all-gather and reduce-scatter, and the all-reduce across the groups.
    assert {"all_gather", "reduce_scatter", "all_reduce"} <= trainer_collectives(spec.parallel)
    assert {"all_gather", "reduce_scatter", "all_reduce"} <= set(spec.permission.collectives)


def test_a_whitelist_without_reduce_scatter_is_refused():
    errs = _errors({"data_parallel_size": 4, "zero_stage": 3, "shard_group_size": 2},
                   permission={"collectives": ["all_reduce", "all_gather", "broadcast"]})
    assert "reduce_scatter" in errs["permission.collectives"]


def test_an_elastic_job_resizes_in_whole_sharding_groups():
    par = {"data_parallel_size": 4, "zero_stage": 3, "shard_group_size": 2, "micro_batch_size": 1,
           "gradient_accumulation_steps": 6}
    rng = _spec(par, elastic={"min_replicas": 2, "max_replicas": 8}).elastic_range
    # The global batch (24) splits into 2, 3, 4, 6 and 8 replicas; groups of 2 keep 2, 4, 6, 8.
    assert rng.sizes() == [8, 6, 4, 2]
    assert not rng.admissible(3)
    errs = _errors(par, elastic={"min_replicas": 3, "max_replicas": 8})
    assert "whole HSDP sharding groups of parallel.shard_group_size (2)" in errs["elastic.min_replicas"]
    # Without groups (or under ZeRO-1, where the field is refused anyway) every size that
    # keeps the batch is admissible.
    plain = _spec({**par, "shard_group_size": None}, elastic={"min_replicas": 2, "max_replicas": 8})
    assert plain.elastic_range.sizes() == [8, 6, 4, 3, 2]


def test_layout_splits_the_data_parallel_dimension_into_consecutive_groups():
    par = ParallelSection(data_parallel_size=4, tensor_parallel_size=2, zero_stage=3,
                          shard_group_size=2)
    lay = Layout.of(par, 8)
    assert lay == Layout(dp=4, pp=1, tp=2, shard_group=2) and lay.shard_groups == 2
    # rank = dp_index * tp + tp_index: dp indices 0,1 | 2,3 are ranks 0,2 | 4,6 at tp_index 0.
    assert lay.shard_group_of(0) == [0, 2] and lay.shard_group_of(6) == [4, 6]
    assert lay.replica_group_of(0) == [0, 4] and lay.replica_group_of(7) == [3, 7]
    # Every rank shards with its group and is replicated once in every other group.
    for r in range(8):
        assert set(lay.shard_group_of(r)) & set(lay.replica_group_of(r)) == {r}


def test_a_group_as_large_as_the_data_parallel_dimension_is_plain_fsdp():
    par = ParallelSection(data_parallel_size=4, zero_stage=3, shard_group_size=4)
    lay = Layout.of(par, 4)
    assert lay.shard_group is None and lay.shard_groups == 1
    assert lay.shard_group_of(1) == [0, 1, 2, 3] and lay.replica_group_of(1) == [1]
    # An elastic restart to a size the groups do not divide is never wired.
    with pytest.raises(ValueError, match="whole groups"):
        Layout.of(ParallelSection(data_parallel_size=4, zero_stage=3, shard_group_size=4), 2)
    with pytest.raises(ValueError, match="whole groups"):
        Layout(dp=6, shard_group=4)


def test_the_job_log_line_shows_the_sharding_groups():
    par = ParallelSection(data_parallel_size=4, zero_stage=3, shard_group_size=2)
    engine = SimpleNamespace(p=par, layout=Layout.of(par, 4), rank=0, manual_dp=False, hierarchy=None)
    line = describe(engine)
    assert "ZeRO-3 (FSDP2), HSDP: 2 sharding groups of 2 (ranks 0,1 | 2,3), replicated" in line
    big = ParallelSection(data_parallel_size=64, zero_stage=2, shard_group_size=8)
    engine = SimpleNamespace(p=big, layout=Layout.of(big, 64), rank=9, manual_dp=False, hierarchy=None)
    assert "8 sharding groups of 8 (ranks 0,1,2,3,4,5,6,7 | 8,9" in describe(engine)
    assert "| ... | 56,57,58,59,60,61,62,63)" in describe(engine)
    plain = ParallelSection(data_parallel_size=4, zero_stage=3)
    engine = SimpleNamespace(p=plain, layout=Layout.of(plain, 4), rank=0, manual_dp=False,
                             hierarchy=None)
    assert "HSDP" not in describe(engine)
