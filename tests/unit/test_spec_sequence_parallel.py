"""`parallel.sequence_parallel`: the layouts the spec refuses (each naming the field, 422 from
the API, exit 2 from the CLI), the collectives it adds, and the plan it lays on a block.
tests/layouts/test_sp_layouts.py trains it against one process."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kuangchao.api.cli import main
from kuangchao.platform.errors import SpecError
from kuangchao.platform.spec.jobspec import validate_spec
from kuangchao.platform.spec.parallel import ParallelSection, parallel_errors, trainer_collectives

from .test_api_edge import SPEC, api  # noqa: F401 -- the fixture

MODEL = {"n_layers": 4, "n_heads": 4, "d_model": 32, "seq_len": 64}
FIELD = "parallel.sequence_parallel"


def _errors(parallel: dict, model: dict = MODEL, **rest) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        validate_spec({"model": model, "parallel": parallel, **rest})
    return dict(info.value.errors)


@pytest.mark.parametrize("parallel, model, words", [
    ({"sequence_parallel": True}, MODEL, "tensor_parallel_size is 1; set tensor_parallel_size to 2"),
    ({"data_parallel_size": 4, "sequence_parallel": True}, MODEL, "tensor_parallel_size is 1"),
    ({"tensor_parallel_size": 4, "sequence_parallel": True}, {**MODEL, "seq_len": 66},
     "4 does not divide model.seq_len (66)"),
    ({"tensor_parallel_size": 2, "sequence_parallel": True},
     {"type": "hf", "path": "/models/llama", "seq_len": 64}, "a Hugging Face or custom model"),
])
def test_layouts_sequence_parallelism_cannot_run_are_refused_with_the_field(parallel, model, words):
    assert words in _errors(parallel, model)[FIELD]


def test_a_custom_entrypoint_cannot_ask_prepare_model_for_it():
    errs = _errors({"tensor_parallel_size": 2, "sequence_parallel": True}, entrypoint="pkg.mod:train")
    assert "built-in trainer only" in errs[FIELD]


@pytest.mark.parametrize("parallel", [
    {"tensor_parallel_size": 2},
    {"tensor_parallel_size": 4, "data_parallel_size": 2, "zero_stage": 3, "recompute": True},
    {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "gradient_accumulation_steps": 2},
    {"tensor_parallel_size": 2, "precision": "bf16"},
])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_it_runs_with_tensor_parallelism_on_the_built_in_models(parallel, kind):
    spec = validate_spec({"model": {**MODEL, "type": kind},
                          "parallel": {**parallel, "sequence_parallel": True}})
    assert spec.parallel.sequence_parallel
    # The reduce-scatters it adds are in the default token's collectives.
    assert "reduce_scatter" in trainer_collectives(spec.parallel)


def test_it_is_off_by_default_and_adds_reduce_scatter_to_the_trainers_collectives():
    assert not ParallelSection().sequence_parallel
    assert "reduce_scatter" not in trainer_collectives(ParallelSection(tensor_parallel_size=2))
    errs = _errors({"tensor_parallel_size": 2, "sequence_parallel": True},
                   permission={"collectives": ["all_reduce", "all_gather", "broadcast"]})
    assert "reduce_scatter" in errs["permission.collectives"]


def test_with_auto_the_planner_picks_tp_and_its_layouts_are_checked_then():
    auto = ParallelSection(auto=True, sequence_parallel=True)
    assert parallel_errors(auto, 4, 4, True, seq_len=64) == []
    # The concrete layout the planner proposes is checked like any other.
    chosen = auto.model_copy(update={"auto": False})
    assert dict(parallel_errors(chosen, 4, 4, True, seq_len=64))[FIELD].startswith(
        "shards activations over the tensor-parallel group")


def test_the_api_answers_422_naming_the_field(api):  # noqa: F811
    store, client, _ = api
    bad = {**SPEC, "parallel": {"sequence_parallel": True}}
    resp = client.post("/v1/jobs?dry_run=true", json=bad)
    assert resp.status_code == 422 and FIELD in resp.text
    assert store.list() == []


def test_the_cli_exits_2_naming_the_field(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps({"model": MODEL, "parallel": {"tensor_parallel_size": 3,
                                                             "sequence_parallel": True}}))
    result = CliRunner().invoke(main.app, ["submit", str(path)])
    assert result.exit_code == 2
    assert FIELD in result.output and "3 does not divide model.seq_len (64)" in result.output


def test_a_blocks_plan_shards_its_norms_and_ends_its_branches_in_sequence_shards():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel

    from kuangchao.workers.models.config import ModelConfig
    from kuangchao.workers.models.factory import build_model
    from kuangchao.workers.parallel.sequence_parallel import sequence_block_plan
    from kuangchao.workers.parallel.tensor_parallel import block_plan

    for kind in ("gpt", "llama"):
        block = build_model(ModelConfig(kind, 1, 4, 32, 16, 64)).blocks[0]
        plan = sequence_block_plan(block, block_plan(block))
        assert {k for k, v in plan.items() if isinstance(v, SequenceParallel)} == {"attn_norm", "mlp_norm"}
        for out in ("attn.o_proj", "mlp.down_proj"):
            assert isinstance(plan[out], RowwiseParallel) and plan[out].output_layouts == (Shard(1),)
    # A branch tensor parallelism does not split Megatron's way (the routed experts) keeps
    # its plan: its input is gathered whole and its output cut back by `wire_block` instead.
    block = build_model(ModelConfig("moe", 1, 4, 32, 16, 64, n_experts=2, top_k=1)).blocks[0]
    styles = block_plan(block)
    plan = sequence_block_plan(block, styles)
    assert plan["attn.o_proj"].output_layouts == (Shard(1),)
    assert not any(k.startswith("moe.") for k in plan)
    merged = {**styles, **plan}  # what apply_tensor_parallel lays on the block
    experts = [v for k, v in merged.items() if k.startswith("moe.experts.") and k.endswith("down_proj")]
    assert experts and all(v.output_layouts != (Shard(1),) for v in experts)
