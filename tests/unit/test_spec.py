"""The job spec: validation messages, inheritance, overrides."""

from pathlib import Path

import pytest

from kuangchao.platform.errors import SpecError
from kuangchao.platform.spec.jobspec import (
    JobSpec,
    apply_overrides,
    deep_merge,
    load_spec,
    validate_spec,
)
from kuangchao.platform.spec.text import parse_spec_text

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def errors_of(doc) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        validate_spec(doc)
    return dict(info.value.errors)


def test_spec_reports_tp_not_dividing_heads_when_tp_is_5():
    errs = errors_of({"model": {"n_heads": 12, "d_model": 96},
                      "parallel": {"tensor_parallel_size": 5}})
    assert errs["parallel.tensor_parallel_size"] == "5 does not divide model.n_heads (12)"


def test_spec_reports_every_field_error_with_its_path_when_several_are_wrong():
    errs = errors_of({"optimizer": {"lr": -1, "type": "adam"}, "training": {"steps": 0},
                      "modle": {}})
    assert set(errs) == {"optimizer.lr", "optimizer.type", "training.steps", "modle"}
    assert "got -1" in errs["optimizer.lr"]
    assert "unknown field" in errs["modle"]


def test_spec_rejects_unknown_model_type_when_not_builtin_or_import_ref():
    errs = errors_of({"model": {"type": "bert"}})
    assert "gpt" in errs["model.type"] and "package.module:function" in errs["model.type"]


def test_spec_accepts_custom_factory_when_given_as_import_ref():
    assert validate_spec({"model": {"type": "mypkg.models:make"}}).model.type == "mypkg.models:make"


def test_spec_rejects_pp_not_dividing_layers_and_bad_entrypoint():
    errs = errors_of({"model": {"n_layers": 3}, "parallel": {"pipeline_parallel_size": 2},
                      "entrypoint": "no colon"})
    assert "does not divide model.n_layers (3)" in errs["parallel.pipeline_parallel_size"]
    assert "package.module:function" in errs["entrypoint"]


def test_spec_world_size_and_gpus_follow_parallel_layout():
    spec = validate_spec({"parallel": {"data_parallel_size": 2, "tensor_parallel_size": 2,
                                       "pipeline_parallel_size": 2,
                                       "gradient_accumulation_steps": 2}})
    assert spec.world_size == 8 and spec.gpus_required == 8


def test_spec_priority_names_map_to_integers():
    assert validate_spec({"task": {"priority": "high"}}).task.priority_value == 100
    assert validate_spec({"task": {"priority": 7}}).task.priority_value == 7


def test_spec_hash_changes_when_any_field_changes():
    a, b = JobSpec(), validate_spec({"training": {"seed": 1}})
    assert a.spec_hash() == JobSpec().spec_hash() != b.spec_hash()


def test_deep_merge_lets_child_win_and_keeps_siblings():
    merged = deep_merge({"a": {"x": 1, "y": 2}, "b": 1}, {"a": {"y": 3}, "c": 4})
    assert merged == {"a": {"x": 1, "y": 3}, "b": 1, "c": 4}


def test_overrides_parse_yaml_scalars_and_create_sections():
    doc = apply_overrides({}, ["training.steps=5", "optimizer.lr=1e-4", "task.name=abc"])
    assert doc == {"training": {"steps": 5}, "optimizer": {"lr": 1e-4}, "task": {"name": "abc"}}


def test_overrides_reject_item_without_equals():
    with pytest.raises(SpecError, match="section.field=value"):
        apply_overrides({}, ["training.steps"])


def test_load_spec_follows_extends_when_example_inherits_base():
    spec = load_spec(EXAMPLES / "tiny-gpt.yaml", ["training.steps=7"])
    assert spec.task.name == "tiny-gpt"
    assert spec.optimizer.lr == 0.003  # from base.yaml
    assert spec.training.steps == 7


def test_load_spec_reports_cycle_when_extends_loops(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(SpecError, match="cycle"):
        load_spec(tmp_path / "a.yaml")


def test_load_spec_reports_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        load_spec(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("a: [1, 2\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(tmp_path / "bad.yaml")


def test_api_body_with_extends_is_refused():
    with pytest.raises(SpecError, match="extends"):
        validate_spec(parse_spec_text("extends: base.yaml\n"))


def test_every_example_job_validates():
    for path in EXAMPLES.glob("*.yaml"):
        if path.name.startswith("cluster"):
            continue
        load_spec(path)


def test_spec_rejects_odd_llama_head_size():
    errs = errors_of({"model": {"type": "llama", "d_model": 36, "n_heads": 4}})
    assert "even head size" in errs["model.d_model"]


def test_spec_refuses_an_elastic_range_that_cannot_keep_the_global_batch():
    errs = errors_of({"parallel": {"data_parallel_size": 2, "micro_batch_size": 4},
                      "elastic": {"min_replicas": 1, "max_replicas": 3}})
    assert "does not split evenly into 3 replica(s)" in errs["elastic.max_replicas"]
    assert "elastic.min_replicas" not in errs
    errs = errors_of({"elastic": {"min_replicas": 4, "max_replicas": 2}})
    assert errs["elastic.min_replicas"] == "4 exceeds elastic.max_replicas (2)"
    errs = errors_of({"elastic": {"resize": "sometimes"}})
    assert "elastic.resize" in errs


def test_live_resizing_is_the_default_only_for_the_built_in_trainer():
    spec = validate_spec({"parallel": {"data_parallel_size": 2, "gradient_accumulation_steps": 2},
                          "elastic": {"min_replicas": 1, "max_replicas": 4}})
    assert spec.live_resize and spec.elastic_range.sizes() == [4, 2, 1]
    custom = validate_spec({"entrypoint": "pkg.mod:fn"})
    assert not custom.live_resize
    assert validate_spec({"entrypoint": "pkg.mod:fn", "elastic": {"resize": "live"}}).live_resize


def test_permission_whitelist_names_collectives_and_covers_the_built_in_trainer():
    errs = errors_of({"permission": {"collectives": ["all_reduce", "teleport"]}})
    assert "teleport not a collective" in errs["permission.collectives"]
    errs = errors_of({"permission": {"collectives": ["all_reduce"]}})
    assert errs["permission.collectives"].startswith("the built-in trainer needs all_gather, broadcast")
    custom = validate_spec({"entrypoint": "pkg.mod:fn", "permission": {"collectives": ["send"]}})
    assert custom.permission.collectives == ["send"]
    assert "permission.token_ttl_seconds" in errors_of({"permission": {"token_ttl_seconds": 5}})


def test_a_checkpoint_path_with_dot_dot_is_refused():
    errs = errors_of({"checkpoint": {"path": "/data/ckpt/../../etc"}})
    assert "contains '..'" in errs["checkpoint.path"]


def test_api_bodies_a_job_record_cannot_hold_are_refused_with_the_field():
    # An emoji as a JSON escape pair is fine; a lone half of one is not.
    assert parse_spec_text('{"args": {"note": "\\ud83d\\ude00"}}')["args"]["note"] == "\U0001F600"
    bad = {
        '{"args": {"note": "\\ud800"}}': ("args.note", "surrogate"),
        "args: !!binary aGVsbG8=\n": ("args", "YAML bytes"),
        "args: &a [*a]\n": ("args.0", "alias"),
        "args: " + "[" * 80 + "]" * 80 + "\n": ("args." + ".".join(["0"] * 63), "too deeply"),
        "args: {n: " + "9" * 5000 + "}\n": ("", "4300 digits"),
    }
    for body, (field, says) in bad.items():
        with pytest.raises(SpecError) as info:
            parse_spec_text(body)
        path, msg = info.value.errors[0]
        assert path == field and says in msg, (body[:40], path, msg)


@pytest.mark.parametrize("wait, ok", [(1.5, True), (4.9, True), (1.4, False), (5.0, False),
                                      (None, True)])
def test_peer_wait_timeout_lies_between_three_beats_and_the_heartbeat_timeout(wait, ok):
    doc = {"fault_tolerance": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 5,
                               "peer_wait_timeout_s": wait}}
    if ok:
        assert validate_spec(doc).fault_tolerance.peer_wait_timeout_s == wait
        return
    message = errors_of(doc)["fault_tolerance.peer_wait_timeout_s"]
    assert message == (f"{wait} must be at least three heartbeat intervals (1.5) and below "
                       "heartbeat_timeout_s (5), or null")
