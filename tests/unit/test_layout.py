"""The 3-D layout (workers/parallel/layout.py) and the layouts the spec refuses
(platform/spec/parallel.py)."""

from __future__ import annotations

import pytest

from kuangchao.platform.errors import SpecError
from kuangchao.platform.spec.jobspec import validate_spec
from kuangchao.platform.spec.parallel import ParallelSection, trainer_collectives
from kuangchao.workers.parallel.layout import Coords, Layout, chunk_layers, node_groups


def test_ranks_follow_placement_order_dp_then_stage_then_tp():
    lay = Layout(dp=2, pp=2, tp=2)
    assert [lay.coords(r) for r in range(4)] == [Coords(0, 0, 0), Coords(0, 0, 1),
                                                 Coords(0, 1, 0), Coords(0, 1, 1)]
    assert all(lay.rank(lay.coords(r)) == r for r in range(8))
    assert lay.tp_group(5) == [4, 5]
    assert lay.pp_group(5) == [5, 7]
    assert lay.dp_group(5) == [1, 5]
    with pytest.raises(ValueError):
        lay.coords(8)


def test_layout_of_a_resized_job_changes_only_dp():
    par = ParallelSection(data_parallel_size=4, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert Layout.of(par, 8) == Layout(dp=2, pp=2, tp=2)
    with pytest.raises(ValueError, match="do not split"):
        Layout.of(par, 6)


def test_interleaved_chunks_and_layers():
    lay = Layout(dp=1, pp=2)
    assert lay.stage_chunks(0, 2) == [0, 2] and lay.stage_chunks(1, 2) == [1, 3]
    assert list(chunk_layers(8, 4, 3)) == [6, 7]
    with pytest.raises(ValueError):
        chunk_layers(6, 4, 0)


def test_node_groups_need_equal_nodes_of_more_than_one_rank():
    assert node_groups([0, 1, 2, 3], {0: "a", 1: "a", 2: "b", 3: "b"}) == [[0, 1], [2, 3]]
    assert node_groups([0, 1, 2, 3], {0: "a", 1: "a", 2: "a", 3: "b"}) is None  # uneven
    assert node_groups([0, 1], {0: "a", 1: "a"}) is None  # one node
    assert node_groups([0, 1], {0: "a", 1: "b"}) is None  # one rank per node: a flat ring


def _errors(parallel: dict, **rest) -> dict[str, str]:
    doc = {"model": {"n_layers": 4, "n_heads": 4, "d_model": 32}, "parallel": parallel, **rest}
    with pytest.raises(SpecError) as info:
        validate_spec(doc)
    return dict(info.value.errors)


@pytest.mark.parametrize("parallel, field, words", [
    ({"offload": True, "zero_stage": 1, "data_parallel_size": 2}, "parallel.offload", "zero_stage: 2"),
    ({"zero_stage": 1, "tensor_parallel_size": 2}, "parallel.zero_stage", "zero_stage 2 or 3"),
    ({"grad_compression": "fp16", "zero_stage": 3}, "parallel.grad_compression", "DDP comm hook"),
    ({"grad_compression": "bf16", "pipeline_parallel_size": 2, "gradient_accumulation_steps": 2},
     "parallel.grad_compression", "not wrapped in DDP"),
    ({"hierarchical_allreduce": "on", "tensor_parallel_size": 2}, "parallel.hierarchical_allreduce",
     "tensor_parallel_size"),
    ({"hierarchical_allreduce": "on", "grad_compression": "powersgd"},
     "parallel.hierarchical_allreduce", "not both"),
    ({"precision": "fp16", "zero_stage": 2, "data_parallel_size": 2}, "parallel.precision", "bf16"),
    ({"precision": "fp16", "pipeline_parallel_size": 2, "gradient_accumulation_steps": 2},
     "parallel.precision", "bf16"),
    ({"pipeline_parallel_size": 2, "schedule": "interleaved_1f1b", "gradient_accumulation_steps": 2},
     "parallel.virtual_stages", "2 or more"),
    ({"pipeline_parallel_size": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2,
      "gradient_accumulation_steps": 3}, "parallel.gradient_accumulation_steps", "multiple"),
    ({"virtual_stages": 2}, "parallel.virtual_stages", "interleaved_1f1b"),
    ({"pipeline_parallel_size": 4, "gradient_accumulation_steps": 2},
     "parallel.gradient_accumulation_steps", "at least 4"),
    ({"pipeline_parallel_size": 2, "schedule": "interleaved_1f1b", "virtual_stages": 4,
      "gradient_accumulation_steps": 2}, "parallel.virtual_stages", "does not divide"),
    ({"auto": True, "data_parallel_size": 2}, "parallel.data_parallel_size", "planner"),
    ({"gpus": 8}, "parallel.gpus", "parallel.auto"),
])
def test_a_layout_the_workers_cannot_run_is_refused_with_its_field(parallel, field, words):
    errors = _errors(parallel)
    assert field in errors, errors
    assert words in errors[field]


def test_live_resize_needs_plain_ddp_and_auto_picks_restart():
    errs = _errors({"zero_stage": 2, "data_parallel_size": 2}, elastic={"resize": "live"})
    assert "resize: restart" in errs["elastic.resize"]
    spec = validate_spec({"parallel": {"zero_stage": 2, "data_parallel_size": 2}})
    assert spec.live_resize is False
    assert validate_spec({"parallel": {"data_parallel_size": 2}}).live_resize is True


def test_a_pipeline_gets_send_and_recv_unless_collectives_are_listed():
    spec = validate_spec({"model": {"n_layers": 4},
                          "parallel": {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 2}})
    assert {"send", "recv"} <= set(spec.permission.collectives)
    assert "send" not in validate_spec({}).permission.collectives  # least privilege
    # A listed whitelist: the built-in trainer's pipeline still brings its own send/recv,
    # a custom entrypoint gets exactly the list.
    listed = {"collectives": ["all_reduce", "broadcast", "all_gather"]}
    par = {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 2}
    spec = validate_spec({"model": {"n_layers": 4}, "parallel": par, "permission": listed})
    assert spec.permission.collectives == ["all_gather", "all_reduce", "broadcast", "recv", "send"]
    custom = validate_spec({"model": {"n_layers": 4}, "parallel": par, "permission": listed,
                            "entrypoint": "pkg.mod:fn"})
    assert custom.permission.collectives == ["all_gather", "all_reduce", "broadcast"]
    assert trainer_collectives(ParallelSection(zero_stage=3)) >= {"reduce_scatter", "all_gather"}


def test_parallel_auto_shorthand_expands():
    spec = validate_spec({"parallel": "auto"})
    assert spec.parallel.auto is True and spec.parallel.world_size == 1


def test_tp_and_pp_need_a_builtin_model():
    errs = _errors({"tensor_parallel_size": 2}, model={"type": "mypkg.models:build", "n_heads": 4})
    assert "built-in models" in errs["model.type"]


def test_the_unsynced_params_drill_needs_ddp():
    errs = _errors({"zero_stage": 3, "data_parallel_size": 2},
                   fault_tolerance={"inject_unsynced_params": ["lm_head.weight"]})
    assert "DDP" in errs["fault_tolerance.inject_unsynced_params"]
