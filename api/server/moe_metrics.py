"""The MoE gauges of `/metrics`: each active mixture-of-experts job's routing at its
last logged step, read from rank 0's progress (platform/observability/routing.py).

Dense jobs have none of these series. A MoE job has them from its first logged
step; a report that does not parse against the job's own spec (its
`model.n_experts`) is left out rather than served half, so the `expert` label
never takes more values than the validated spec allows.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from kuangchao.platform.jobs.state import JobRecord
from kuangchao.platform.observability import metrics as m
from kuangchao.platform.observability.routing import job_routing


def _gauge(d: m.MetricDef) -> GaugeMetricFamily:
    return GaugeMetricFamily(d.name, d.help, labels=d.labels)


def moe_families(jobs: list[JobRecord], progress: Mapping[str, Mapping[str, Any]]) -> Iterator[Metric]:
    """The gauges of `metrics.MOE` for `jobs`, from each job's progress (`progress[job.id]`)."""
    load, imbalance = _gauge(m.JOB_EXPERT_LOAD), _gauge(m.JOB_EXPERT_IMBALANCE)
    dropped, aux, z = _gauge(m.JOB_MOE_DROPPED), _gauge(m.JOB_MOE_AUX_LOSS), _gauge(m.JOB_MOE_Z_LOSS)
    for job in jobs:
        stats = job_routing(job.spec, progress.get(job.id) or {})
        if stats is None:
            continue
        for expert, tokens in enumerate(stats.expert_load):
            load.add_metric([job.id, str(expert)], tokens)
        if stats.imbalance is not None:
            imbalance.add_metric([job.id], stats.imbalance)
        dropped.add_metric([job.id], stats.dropped_tokens)
        aux.add_metric([job.id], stats.aux_loss)
        z.add_metric([job.id], stats.z_loss)
    yield from (load, imbalance, dropped, aux, z)
