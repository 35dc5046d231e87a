"""The goodput gauges of `/metrics`: each active job's split and the active jobs' sum.

Splits come from the process's goodput cache (platform/control/goodput.py), so a
scrape recomputes only the jobs whose record changed or whose split aged past
the cache's limit; in between, a live job's open time is added to its open
cause. Finished jobs leave the series, as every per-job gauge here does; their
splits stay on the job JSON and in `GET /v1/goodput`. Labels stay bounded: one
`job` per active job and the fixed `cause` set.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from kuangchao.platform.control.goodput import cache_for
from kuangchao.platform.jobs.state import JobRecord
from kuangchao.platform.observability import metrics as m
from kuangchao.platform.observability.goodput import total


def _gauge(d: m.MetricDef) -> GaugeMetricFamily:
    return GaugeMetricFamily(d.name, d.help, labels=d.labels)


def goodput_families(store: Any, jobs: list[JobRecord], now: float) -> Iterator[Metric]:
    """kc_job_goodput_seconds, kc_job_ettr_ratio and their cluster sums, for `jobs`."""
    cache = cache_for(store)
    per_job, ettr = _gauge(m.JOB_GOODPUT), _gauge(m.JOB_ETTR)
    splits = []
    for job in jobs:
        split = cache.get(store, job, now)
        if split is None:
            continue
        splits.append(split)
        per_job.add_metric([job.id, "productive"], split.productive_s)
        for cause in m.GOODPUT_CAUSES[1:]:
            per_job.add_metric([job.id, cause], split.by_cause.get(cause, 0.0))
        if split.ettr is not None:
            ettr.add_metric([job.id], split.ettr)
    summed = total(splits)
    cluster = _gauge(m.CLUSTER_GOODPUT)
    cluster.add_metric(["productive"], summed["productive_s"])
    for cause, secs in summed["by_cause"].items():
        cluster.add_metric([cause], secs)
    cluster_ettr = _gauge(m.CLUSTER_ETTR)
    if summed["ettr"] is not None:
        cluster_ettr.add_metric([], summed["ettr"])
    yield from (per_job, ettr, cluster, cluster_ettr)
