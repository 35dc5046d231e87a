"""Stored specs are read through platform/spec/defaults.py: a value, or the spec's own default."""

import pytest

from kuangchao.platform.scheduling.policies import shape_of
from kuangchao.platform.spec.defaults import default, value
from kuangchao.platform.spec.elastic import elastic_range
from kuangchao.platform.spec.jobspec import JobSpec

RESOLVED = JobSpec().model_dump(mode="json")


SECTIONS = ("model", "parallel", "training", "data", "fault_tolerance", "checkpoint", "elastic")


@pytest.mark.parametrize("section, name", [(s, n) for s in SECTIONS
                                           for n in JobSpec.model_fields[s].annotation.model_fields])
def test_a_record_without_the_field_reads_the_specs_default(section, name):
    assert default(section, name) == RESOLVED[section][name]
    assert value({}, section, name) == RESOLVED[section][name]
    assert value({section: {}}, section, name) == RESOLVED[section][name]


def test_a_stored_value_wins_over_the_default_even_when_it_is_none():
    assert value({"fault_tolerance": {"max_restarts": 0}}, "fault_tolerance", "max_restarts") == 0
    assert value({"elastic": {"min_replicas": None}}, "elastic", "min_replicas") is None


def test_an_old_record_without_parallel_fields_has_the_resolved_specs_shape_and_range():
    assert shape_of({}) == shape_of(RESOLVED)
    assert elastic_range({}) == elastic_range(RESOLVED)


def test_a_field_the_spec_does_not_have_is_a_key_error():
    with pytest.raises(KeyError):
        default("parallel", "no_such_field")
