"""The spec a job record stores, and the typed spec readers take back from it."""

import logging

import pytest

from kuangchao.platform.errors import SpecError
from kuangchao.platform.spec.jobspec import JobSpec, validate_spec
from kuangchao.platform.spec.stored import spec_of, stored_form

USER_DOC = {"task": {"name": "tiny"}, "parallel": {"data_parallel_size": 2, "gradient_accumulation_steps": 2},
            "elastic": {"min_replicas": 1, "max_replicas": 4}}


def test_the_stored_form_has_every_default_filled_in():
    doc = stored_form(validate_spec(USER_DOC))
    assert doc["fault_tolerance"]["max_restarts"] == 3
    assert doc["checkpoint"]["path"] == "checkpoints"
    assert set(doc) == set(JobSpec.model_fields)


def test_a_stored_spec_reads_back_as_the_spec_it_was():
    spec = validate_spec(USER_DOC)
    assert spec_of(stored_form(spec)) == spec


def test_an_old_record_without_the_newer_fields_reads_with_the_specs_defaults():
    # A record from before the elastic section, async checkpoints and training.compile.
    old = {"task": {"name": "old", "priority": "high"},
           "parallel": {"data_parallel_size": 2, "micro_batch_size": 4},
           "checkpoint": {"interval_steps": 10, "path": "/ckpt/old"}}
    spec = spec_of(old)
    assert spec.checkpoint.path == "/ckpt/old" and spec.checkpoint.async_save is True
    assert spec.training.compile is False and spec.fault_tolerance.max_restarts == 3
    rng = spec.elastic_range
    assert (rng.min_replicas, rng.max_replicas, rng.global_batch) == (2, 2, 8)
    assert spec.task.priority_value == 100


def test_a_field_the_spec_has_dropped_is_read_without_it_and_warned_about(caplog):
    old = {"parallel": {"data_parallel_size": 2, "retired_knob": 1}, "legacy": True}
    with caplog.at_level(logging.WARNING, logger="kuangchao.platform.spec.stored"):
        spec = spec_of(old)
    assert spec.parallel.data_parallel_size == 2
    assert "parallel.retired_knob" in caplog.text and "legacy" in caplog.text


def test_a_stored_value_of_the_wrong_type_names_the_field():
    with pytest.raises(SpecError) as info:
        spec_of({"parallel": {"data_parallel_size": "many"}, "gone": 1})
    paths = [p for p, _ in info.value.errors]
    assert "stored spec: parallel.data_parallel_size" in paths


def test_the_typed_range_matches_the_one_read_from_the_document():
    from kuangchao.platform.spec.elastic import elastic_range

    for doc in ({}, USER_DOC, {"parallel": {"data_parallel_size": 4, "tensor_parallel_size": 2,
                                            "gradient_accumulation_steps": 3},
                               "elastic": {"max_replicas": 6}}):
        assert spec_of(doc).elastic_range == elastic_range(doc)
