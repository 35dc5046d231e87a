"""The control plane's metrics, as `/metrics` serves them.

At each scrape: gauges read from the job store (a handful of pipelined
Redis round trips, whatever the number of jobs), and the counters and
histograms the scheduler, controllers, ranks and token authority recorded
(`platform/observability/metrics.py`).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kuangchao.api.server.goodput_metrics import goodput_families
from kuangchao.api.server.moe_metrics import moe_families
from kuangchao.platform.cluster import quarantine
from kuangchao.platform.jobs.state import JobRecord, JobState
from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.observability import metrics as m
from kuangchao.platform.spec.defaults import value
from kuangchao.platform.spec.queues import QueueTable

_BY_NAME = {d.name: d for d in m.ALL}


def _family(d: m.MetricDef) -> Metric:
    if d.kind == "counter":
        return CounterMetricFamily(d.name.removesuffix("_total"), d.help, labels=d.labels)
    if d.kind == "histogram":
        return HistogramMetricFamily(d.name, d.help, labels=d.labels)
    return GaugeMetricFamily(d.name, d.help, labels=d.labels)


def recorded_families(samples: Iterable[m.Sample]) -> Iterator[Metric]:
    """Counters, recorded gauges and histograms from recorded samples (unknown series
    are dropped)."""
    counters: dict[str, list[m.Sample]] = defaultdict(list)
    hist: dict[str, dict[tuple, dict[str, Any]]] = defaultdict(dict)
    for s in samples:
        if s.series in _BY_NAME and _BY_NAME[s.series].kind in ("counter", "gauge"):
            counters[s.series].append(s)
            continue
        base, _, part = s.series.rpartition("_")
        if base not in _BY_NAME or part not in ("bucket", "sum", "count"):
            continue
        labels = {k: v for k, v in s.labels.items() if k != "le"}
        key = tuple(labels.get(name, "") for name in _BY_NAME[base].labels)
        entry = hist[base].setdefault(key, {"buckets": {}, "sum": 0.0})
        if part == "bucket":
            entry["buckets"][s.labels.get("le", "+Inf")] = s.value
        elif part == "sum":
            entry["sum"] = s.value
    for name, items in counters.items():
        d = _BY_NAME[name]
        fam = _family(d)
        for s in items:
            fam.add_metric([s.labels.get(label, "") for label in d.labels], s.value)
        yield fam
    for name, series in hist.items():
        d = _BY_NAME[name]
        fam = _family(d)
        for key, entry in series.items():
            bounds = [m._le(b) for b in (*d.buckets, math.inf)]
            buckets = [(le, entry["buckets"].get(le, 0.0)) for le in bounds]
            fam.add_metric(list(key), buckets, entry["sum"])
        yield fam


class ClusterCollector:
    """A prometheus_client collector over one job store."""

    def __init__(self, store: JobStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        now = time.time()
        store = self.store
        jobs = store.list_active()
        reads = self._read(jobs)
        yield from self._job_gauges(jobs, reads, now)
        yield from moe_families(jobs, reads["progress"])
        yield from goodput_families(store, jobs, now)
        yield from self._queue_gauges(jobs, QueueTable.from_json(reads["queues"]), now)
        yield from self._node_gauges(jobs, reads["nodes"], now)
        samples = m.parse_hash(reads["cluster"])
        zeros = [z for d in m.CLUSTER_RECORDED for z in m.zero_samples(d)]
        for queue in QueueTable.from_json(reads["queues"]).names:  # queues known only now
            zeros += m.zero_samples(m.JOBS_FINISHED, {"queue": queue})
            zeros += m.zero_samples(m.QUEUE_WAIT, {"queue": queue})
        for job in jobs:
            samples += m.own_job_samples(m.parse_hash(reads["jobs"][job.id]), job.id)
            zeros += [z for d in m.JOB_RECORDED for z in m.zero_samples(d, {"job": job.id})]
        yield from recorded_families(m.merge(samples, zeros))

    def _read(self, jobs: list[JobRecord]) -> dict[str, Any]:
        """Everything the gauges need, in one read of the store."""
        reads = self.store.read_for_gauges([(job.id, job.world_size) for job in jobs])
        reads["nodes"] = reads["nodes"] or {"nodes": []}
        return reads

    def _job_gauges(self, jobs: list[JobRecord], reads: dict[str, Any],
                    now: float) -> Iterator[Metric]:
        fams = {d.name: _family(d) for d in (m.JOB_INFO, m.JOB_STATE_AGE, m.JOB_RECOVERING,
                                              m.JOB_WORLD_SIZE,
                                              m.JOB_STEP, m.JOB_TOTAL_STEPS, m.JOB_LOSS,
                                              m.JOB_EVAL_LOSS,
                                              m.CHECKPOINT_AGE, m.HEARTBEAT_AGE, m.HEARTBEAT_UP)}
        for job in jobs:
            state = job.state.value
            fams["kc_job_info"].add_metric([job.id, job.name, job.queue, job.tenant, state], 1)
            since = job.state_since or job.created_at
            fams["kc_job_state_age_seconds"].add_metric([job.id, state], max(0.0, now - since))
            recovering = now - since if job.state is JobState.RECOVERING else 0.0
            fams["kc_job_recovering_seconds"].add_metric([job.id], max(0.0, recovering))
            fams["kc_job_world_size"].add_metric([job.id], job.world_size)
            progress = reads["progress"][job.id]
            total = progress.get("total_steps") or value(job.spec, "training", "steps")
            fams["kc_job_step"].add_metric([job.id], float(progress.get("step") or 0))
            if isinstance(total, int | float):
                fams["kc_job_total_steps"].add_metric([job.id], float(total))
            for key, name in (("loss", "kc_job_loss"), ("eval_loss", "kc_job_eval_loss")):
                if isinstance(progress.get(key), int | float):  # eval_loss: once evaluated
                    fams[name].add_metric([job.id], float(progress[key]))
            if job.state in (JobState.RUNNING, JobState.RECOVERING, JobState.RESIZING):
                ckpt = reads["checkpoint"][job.id] or {}
                last = ckpt.get("committed_at") or job.started_at or job.created_at
                fams["kc_job_checkpoint_age_seconds"].add_metric([job.id], max(0.0, now - last))
            if not job.state.holds_resources or job.state is JobState.PLACING:
                continue
            for rank, beat in enumerate(reads["beats"][job.id][:job.world_size]):
                fams["kc_rank_heartbeat_up"].add_metric([job.id, str(rank)], 1 if beat else 0)
                if beat is not None:
                    fams["kc_rank_heartbeat_age_seconds"].add_metric(
                        [job.id, str(rank), beat.node], max(0.0, now - beat.ts))
        yield from fams.values()

    @staticmethod
    def _queue_gauges(jobs: list[JobRecord], table: QueueTable, now: float) -> Iterator[Metric]:
        names = list(dict.fromkeys([*table.names, *(j.queue for j in jobs)]))
        counts = {(s, q): 0 for s in m.ACTIVE_STATES for q in names}
        oldest = dict.fromkeys(names, 0.0)
        used = dict.fromkeys(names, 0)
        for job in jobs:
            counts[(job.state.value, job.queue)] = counts.get((job.state.value, job.queue), 0) + 1
            if job.state is JobState.QUEUED:
                waited = now - (job.state_since or job.created_at)
                oldest[job.queue] = max(oldest[job.queue], waited)
            elif job.state.holds_resources:
                used[job.queue] += job.gpus
        fam = _family(m.JOBS)
        for (state, queue), n in counts.items():
            fam.add_metric([state, queue], n)
        yield fam
        fam = _family(m.QUEUE_OLDEST_WAIT)
        for queue, waited in oldest.items():
            fam.add_metric([queue], max(0.0, waited))
        yield fam
        fam = _family(m.QUEUE_GPUS)
        for queue in names:
            fam.add_metric([queue, "used"], used[queue])
            q = table.get(queue)
            fam.add_metric([queue, "guaranteed"], q.guaranteed_gpus if q else 0)
        yield fam

    def _node_gauges(self, jobs: list[JobRecord], info: dict[str, Any],
                     now: float) -> Iterator[Metric]:
        blocked = quarantine.active(self.store.quarantine(), now)
        status = {"alive": 0, "lost": 0, "quarantined": 0, "draining": 0}
        total = 0
        for n in info.get("nodes", []):
            if n.get("name") in blocked:
                status["quarantined"] += 1
            elif n.get("alive", True) and n.get("draining"):
                # Nothing new lands on a node Ray drains: its GPUs are no capacity.
                status["draining"] += 1
            elif n.get("alive", True):
                status["alive"] += 1
                total += int(n.get("gpus", 0))
            else:
                status["lost"] += 1
        used = sum(j.gpus for j in jobs if j.state.holds_resources)
        fam = _family(m.NODES)
        for s, n in status.items():
            fam.add_metric([s], n)
        yield fam
        fam = _family(m.CLUSTER_GPUS)
        for kind, n in (("total", total), ("used", used), ("free", max(0, total - used))):
            fam.add_metric([kind], n)
        yield fam
