"""Every example job spec in examples/ validates as shipped."""

from pathlib import Path

import pytest

from kuangchao.platform.spec.jobspec import load_spec

ROOT = Path(__file__).resolve().parents[2]
JOBS = [p for p in sorted((ROOT / "examples").glob("*.yaml"))
        if not p.name.startswith("cluster-") and p.name != "queues.yaml"]


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_example_spec_validates(path):
    load_spec(path)


def test_the_fault_drill_turns_on_what_docs_describe():
    spec = load_spec(ROOT / "examples" / "fault-drill.yaml")
    ft = spec.fault_tolerance
    assert ft.spare_workers and ft.inject_nan_at_batches == [90]
    assert spec.checkpoint.interval_steps == 40 and spec.training.steps == 400
