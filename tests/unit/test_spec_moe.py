"""`model.type: moe` and `parallel.expert_parallel_size`: what the spec refuses (each naming
the field: 422 from the API, exit 2 from the CLI), and the all_to_all that expert
parallelism, and only it, brings into the token's collectives.
tests/layouts/test_moe_layouts.py trains the layouts against one process."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kuangchao.api.cli import main
from kuangchao.platform.errors import SpecError
from kuangchao.platform.spec.jobspec import validate_spec
from kuangchao.platform.spec.parallel import ParallelSection, trainer_collectives

from .test_api_edge import SPEC, api  # noqa: F401 -- the fixture

MOE = {"type": "moe", "n_layers": 2, "n_heads": 4, "d_model": 32, "seq_len": 16,
       "n_experts": 4, "top_k": 2}
EP = "parallel.expert_parallel_size"


def _errors(parallel: dict, model: dict = MOE, **rest) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        validate_spec({"model": model, "parallel": parallel, **rest})
    return dict(info.value.errors)


def test_a_moe_spec_takes_its_defaults_and_validates_again_as_dumped():
    spec = validate_spec({"model": {"type": "moe"}})
    m = spec.model
    assert (m.n_experts, m.top_k, m.capacity_factor, m.aux_loss_coef, m.z_loss_coef) == \
        (8, 2, 1.25, 0.01, 0.001)
    assert m.is_builtin and spec.parallel.expert_parallel_size == 1
    assert validate_spec(spec.model_dump(mode="json")) == spec
    # A dense model's dump carries the MoE defaults too, and validates again.
    dense = validate_spec({})
    assert validate_spec(dense.model_dump(mode="json")) == dense


@pytest.mark.parametrize("parallel, model, field, words", [
    ({"data_parallel_size": 4, "expert_parallel_size": 4}, {**MOE, "n_experts": 6}, EP,
     "4 does not divide model.n_experts (6)"),
    ({}, {**MOE, "top_k": 5}, "model.top_k", "5 exceeds model.n_experts (4)"),
    ({"data_parallel_size": 2, "expert_parallel_size": 2}, {**MOE, "type": "llama"}, EP,
     "model.type 'llama' has none: set model.type: moe"),
    ({}, {**MOE, "type": "gpt"}, "model.n_experts", "is for model.type moe only"),
    ({}, {"type": "gpt", "capacity_factor": 2.0}, "model.capacity_factor", "model.type moe only"),
    ({"data_parallel_size": 2, "expert_parallel_size": 4}, MOE, EP,
     "4 does not divide data_parallel_size (2); expert-parallel ranks are carved out"),
    ({"data_parallel_size": 4, "expert_parallel_size": 2, "zero_stage": 1}, MOE,
     "parallel.zero_stage", "use zero_stage 0, 2 or 3"),
    ({"data_parallel_size": 4, "expert_parallel_size": 2, "zero_stage": 3, "shard_group_size": 2},
     MOE, "parallel.shard_group_size", "do not combine with expert parallelism"),
    ({"data_parallel_size": 2, "expert_parallel_size": 2, "grad_compression": "bf16"}, MOE,
     "parallel.grad_compression", "not wrapped in DDP"),
    ({"data_parallel_size": 2, "expert_parallel_size": 2, "hierarchical_allreduce": "on"}, MOE,
     "parallel.hierarchical_allreduce", "not wrapped in DDP"),
    ({"precision": "fp16"}, MOE, "parallel.precision", "use precision: bf16"),
    ({}, {**MOE, "d_model": 30, "n_heads": 6}, "model.d_model", "moe needs an even head size"),
])
def test_layouts_and_shapes_a_mixture_of_experts_cannot_run_are_refused_with_the_field(
        parallel, model, field, words):
    assert words in _errors(parallel, model)[field]


def test_a_mixture_of_experts_is_not_compiled():
    errs = _errors({}, training={"compile": True})
    assert "set training.compile: false" in errs["training.compile"]


def test_expert_parallelism_is_refused_to_a_custom_entrypoint_and_to_mixed_speed_shares():
    errs = _errors({"data_parallel_size": 2, "expert_parallel_size": 2}, entrypoint="pkg.mod:train")
    assert "built-in trainer" in errs[EP]
    errs = _errors({"data_parallel_size": 2}, resources={"heterogeneous": True})
    assert "set balance: even" in errs["resources.balance"]
    validate_spec({"model": MOE, "parallel": {"data_parallel_size": 2},
                   "resources": {"heterogeneous": True, "balance": "even"}})


def test_an_elastic_range_keeps_whole_expert_parallel_groups():
    errs = _errors({"data_parallel_size": 4, "expert_parallel_size": 2},
                   elastic={"min_replicas": 3, "max_replicas": 4})
    assert "groups of expert-parallel ranks" in errs["elastic.min_replicas"]
    spec = validate_spec({"model": MOE, "parallel": {"data_parallel_size": 4, "expert_parallel_size": 2},
                          "elastic": {"min_replicas": 2, "max_replicas": 4}})
    assert spec.elastic_range.sizes() == [4, 2]
    assert not spec.live_resize  # expert parallelism resizes by restart


@pytest.mark.parametrize("parallel", [
    {"data_parallel_size": 2, "expert_parallel_size": 2},
    {"data_parallel_size": 4, "expert_parallel_size": 2, "zero_stage": 3, "recompute": True},
    {"data_parallel_size": 2, "expert_parallel_size": 2, "tensor_parallel_size": 2},
    {"data_parallel_size": 2, "expert_parallel_size": 2, "pipeline_parallel_size": 2,
     "gradient_accumulation_steps": 2},
    {"data_parallel_size": 4, "expert_parallel_size": 4, "precision": "bf16", "zero_stage": 2},
])
def test_expert_parallel_layouts_get_all_to_all_in_their_tokens(parallel):
    spec = validate_spec({"model": MOE, "parallel": parallel})
    assert "all_to_all" in spec.permission.collectives
    assert "all_to_all" in trainer_collectives(spec.parallel)
    if spec.parallel.pipeline_parallel_size > 1:
        assert {"send", "recv"} <= set(spec.permission.collectives)


def test_a_job_without_expert_parallelism_gets_no_all_to_all():
    for doc in ({"model": MOE, "parallel": {"data_parallel_size": 4}}, {},
                {"parallel": {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 2}}):
        spec = validate_spec(doc)
        assert "all_to_all" not in spec.permission.collectives
        assert "all_to_all" not in trainer_collectives(spec.parallel)
    assert "all_to_all" not in trainer_collectives(ParallelSection(data_parallel_size=8))


def test_a_listed_whitelist_gets_all_to_all_added_for_the_built_in_trainer():
    spec = validate_spec({"model": MOE, "parallel": {"data_parallel_size": 2, "expert_parallel_size": 2},
                          "permission": {"allowed_interfaces": ["all_reduce", "all_gather", "broadcast"]}})
    assert spec.permission.collectives == ["all_gather", "all_reduce", "all_to_all", "broadcast"]


def test_the_api_answers_422_naming_the_field(api):  # noqa: F811
    store, client, _ = api
    bad = {**SPEC, "model": {**MOE, "n_experts": 6},
           "parallel": {"data_parallel_size": 4, "expert_parallel_size": 4}}
    resp = client.post("/v1/jobs?dry_run=true", json=bad)
    assert resp.status_code == 422 and EP in resp.text and "model.n_experts (6)" in resp.text
    resp = client.post("/v1/jobs?dry_run=true", json={**SPEC, "model": {**MOE, "top_k": 9}})
    assert resp.status_code == 422 and "model.top_k" in resp.text
    assert store.list() == []


def test_the_cli_exits_2_naming_the_field(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps({"model": {**MOE, "n_experts": 6},
                                "parallel": {"data_parallel_size": 4, "expert_parallel_size": 4}}))
    result = CliRunner().invoke(main.app, ["submit", str(path)])
    assert result.exit_code == 2
    assert EP in result.output and "does not divide model.n_experts (6)" in result.output
