"""Every metric kuangchao exports, declared once, and their Redis-backed record.

Names start with `kc_` and carry their unit (`_seconds`, `_bytes`, `_total`,
`_ratio`). Two families:

- **Control plane**, served by the API server's `/metrics`. Gauges are read
  from the job store at scrape time (jobs by state, queue waits, heartbeat
  ages). Counters and histograms are recorded where the event happens: the
  scheduler, a job's controller, a rank (checkpoint timings), the token
  authority. They live in Redis hashes, so they outlive the process that
  recorded them, add up across processes, and any API replica serves the
  same numbers.
- **Workers**, served by each rank's own endpoint (`workers/runtime/telemetry.py`);
  Prometheus finds those through the file_sd list the control plane writes
  (`platform/observability/scrape_targets.py`).

Per-job series carry the label `job` (the kuangchao job id). On the API's
series Prometheus keeps it with `honor_labels: true`, and the API serves from a
job's hash only that job's own series (`own_job_samples`); on a rank's, the
label comes from service discovery, never from the rank
(deploy/prometheus/prometheus.yml).

Pure: the store hands recorders their write, and nothing here imports Redis or Ray.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kuangchao.platform.observability.goodput import CAUSES
from kuangchao.platform.protocol.interfaces import INTERFACES

log = logging.getLogger(__name__)

SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
                   600, 1800, 3600)
FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                0.5, 1, 2.5, 5)

# What a failure is recorded as (platform/execution/recovery.py `Failure.kind`).
FAILURE_CAUSES = ("died", "node_lost", "expired", "hung", "numeric", "controller", "placement",
                  "resize")
# What a capability token may refuse (platform/protocol/interfaces.py).
TOKEN_INTERFACES = tuple(sorted(INTERFACES))
# Where a job's wall-clock time went (observability/goodput.py): kept steps, then the causes.
GOODPUT_CAUSES = ("productive", *CAUSES)
ACTIVE_STATES = ("QUEUED", "PLACING", "RUNNING", "RECOVERING", "RESIZING")
FINAL_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")


@dataclass(frozen=True)
class MetricDef:
    """One metric: its kind, help text and labels.

    `zero` names label values whose series exist (at 0) before anything was
    recorded, so that `rate()` and `increase()` see the first event, and a
    dashboard shows 0 rather than no data.
    """

    name: str
    kind: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = SECONDS_BUCKETS
    zero: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


def _m(name: str, kind: str, help: str, *labels: str, **kw: Any) -> MetricDef:
    return MetricDef(name, kind, help, tuple(labels), **kw)


# -- control plane ------------------------------------------------------------
# Read from the store at scrape time (api/server/cluster_metrics.py).
JOBS = _m("kc_jobs", "gauge", "Jobs by state and queue (finished jobs: see "
          "kc_jobs_finished_total)", "state", "queue")
JOB_INFO = _m("kc_job_info", "gauge", "1 for every active job, with its name, queue, tenant "
              "and state", "job", "name", "queue", "tenant", "state")
JOB_STATE_AGE = _m("kc_job_state_age_seconds", "gauge", "Seconds an active job has been in its "
                   "current state", "job", "state")
JOB_RECOVERING = _m("kc_job_recovering_seconds", "gauge", "Seconds an active job has been "
                    "RECOVERING (0 when it is not)", "job")
JOB_WORLD_SIZE = _m("kc_job_world_size", "gauge", "Ranks of an active job", "job")
JOB_STEP = _m("kc_job_step", "gauge", "Optimizer steps an active job has completed", "job")
JOB_TOTAL_STEPS = _m("kc_job_total_steps", "gauge", "Optimizer steps an active job will run",
                     "job")
JOB_LOSS = _m("kc_job_loss", "gauge", "Global mean loss at the last logged step", "job")
JOB_EVAL_LOSS = _m("kc_job_eval_loss", "gauge", "Mean loss on the held-out split at the job's "
                   "last evaluation (every training.eval_interval steps)", "job")
# A mixture of experts' routing at its last logged step (platform/observability/routing.py):
# MoE jobs only; `expert` is bounded by the spec's model.n_experts (at most 1024).
JOB_EXPERT_LOAD = _m("kc_job_expert_load_tokens", "gauge", "Token-expert assignments a MoE "
                     "job's router made to each expert at its last logged step, over every rank, "
                     "before capacity drops any", "job", "expert")
JOB_EXPERT_IMBALANCE = _m("kc_job_expert_imbalance_ratio", "gauge", "A MoE job's busiest "
                          "expert load over the mean at its last logged step (1 = even)", "job")
JOB_MOE_DROPPED = _m("kc_job_moe_dropped_tokens", "gauge", "Token-expert assignments a MoE job "
                     "dropped over expert capacity at its last logged step", "job")
JOB_MOE_AUX_LOSS = _m("kc_job_moe_aux_loss", "gauge", "A MoE job's load-balancing loss at its "
                      "last logged step, before model.aux_loss_coef (1 = even)", "job")
JOB_MOE_Z_LOSS = _m("kc_job_moe_z_loss", "gauge", "A MoE job's router z-loss at its last "
                    "logged step, before model.z_loss_coef", "job")
MOE = (JOB_EXPERT_LOAD, JOB_EXPERT_IMBALANCE, JOB_MOE_DROPPED, JOB_MOE_AUX_LOSS, JOB_MOE_Z_LOSS)
CHECKPOINT_AGE = _m("kc_job_checkpoint_age_seconds", "gauge", "Seconds since a running job's "
                    "newest committed checkpoint (since it started, before its first)", "job")
HEARTBEAT_AGE = _m("kc_rank_heartbeat_age_seconds", "gauge", "Seconds since a rank's last "
                   "heartbeat", "job", "rank", "node")
HEARTBEAT_UP = _m("kc_rank_heartbeat_up", "gauge", "1 when a placed rank's heartbeat is present, "
                  "0 when it is missing", "job", "rank")
JOB_GOODPUT = _m("kc_job_goodput_seconds", "gauge", "An active job's wall-clock time since submit "
                 "by where it went: productive (kept steps) or the cause of the loss "
                 "(platform/observability/goodput.py)", "job", "cause")
JOB_ETTR = _m("kc_job_ettr_ratio", "gauge", "An active job's effective training time ratio: "
              "productive seconds over wall-clock seconds since submit", "job")
CLUSTER_GOODPUT = _m("kc_cluster_goodput_seconds", "gauge", "Every active job's wall-clock time "
                     "since submit, summed, by where it went", "cause")
CLUSTER_ETTR = _m("kc_cluster_ettr_ratio", "gauge", "The active jobs' ETTR, weighted by their "
                  "wall-clock time: productive seconds over wall-clock seconds, summed")
QUEUE_OLDEST_WAIT = _m("kc_queue_oldest_wait_seconds", "gauge", "How long the longest-waiting "
                       "queued job of a queue has waited (0 when none waits)", "queue")
QUEUE_GPUS = _m("kc_queue_gpus", "gauge", "GPUs held by a queue's jobs, and its quota",
                "queue", "kind")
CLUSTER_GPUS = _m("kc_cluster_gpus", "gauge", "GPUs of live nodes: used, free, total", "kind")
NODES = _m("kc_nodes", "gauge", "Nodes by status (alive, lost, quarantined, draining)", "status")

# Recorded where they happen.
JOBS_FINISHED = _m("kc_jobs_finished_total", "counter", "Jobs that reached a final state",
                   "state", "queue", zero={"state": FINAL_STATES})
QUEUE_WAIT = _m("kc_queue_wait_seconds", "histogram", "From a job entering the queue to its "
                "admission", "queue")
PLACEMENT_SOLVE = _m("kc_placement_solve_seconds", "histogram", "Time the placement solver took "
                     "for an admitted job", buckets=FAST_BUCKETS)
SCHEDULER_CYCLE = _m("kc_scheduler_cycle_seconds", "histogram", "One scheduling cycle: snapshot, "
                     "decisions and their writes", buckets=FAST_BUCKETS)
FAILURE_DETECTION = _m("kc_failure_detection_seconds", "histogram", "From a rank's last good "
                       "heartbeat (or progress, for a hang) to the controller marking it failed",
                       "cause", zero={"cause": FAILURE_CAUSES})
RESTARTS = _m("kc_job_restarts_total", "counter", "Restarts of a job by cause", "job", "cause",
              zero={"cause": FAILURE_CAUSES})
RESIZES = _m("kc_job_resizes_total", "counter", "Finished resizes of an elastic job", "job")
RESIZE_SECONDS = _m("kc_job_resize_seconds", "histogram", "From a resize decision to the first "
                    "step at the new size", "job")
CHECKPOINT_SAVE = _m("kc_checkpoint_save_seconds", "histogram", "Writing a checkpoint, from the "
                     "start of the save to its commit", "job")
CHECKPOINT_BLOCKED = _m("kc_checkpoint_blocked_seconds", "histogram", "How long a checkpoint "
                        "blocked training (staging only, for a background write)", "job")
CHECKPOINT_LOAD = _m("kc_checkpoint_load_seconds", "histogram", "Restoring a job from its "
                     "newest checkpoint that verifies", "job")
CHECKPOINT_BYTES = _m("kc_checkpoint_saved_bytes_total", "counter", "Bytes of committed "
                      "checkpoints", "job")
MEMORY_CHECKPOINT_BYTES = _m("kc_job_memory_checkpoint_bytes", "gauge", "Bytes of peer-memory "
                             "checkpoint copies a job's keeper on a node holds "
                             "(checkpoint.in_memory; read every 10 s)", "job", "node")
TOKEN_DENIALS = _m("kc_token_denials_total", "counter", "Operations a rank's capability token "
                   "refused", "job", "interface", zero={"interface": TOKEN_INTERFACES})

# The API's own (api/server/metrics.py records these in-process: one series per API replica).
API_REQUEST = _m("kc_api_request_duration_seconds", "histogram", "API request latency by route "
                 "and status", "method", "route", "status",
                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
API_AUTH_DENIALS = _m("kc_api_auth_denials_total", "counter", "API requests refused by "
                      "authentication (401) or authorisation (403)", "status")

STORE_UP = _m("kc_store_up", "gauge", "1 when the API server could read the job store at this "
               "scrape (the control-plane series are missing when 0)")

CLUSTER_RECORDED = (JOBS_FINISHED, QUEUE_WAIT, PLACEMENT_SOLVE, SCHEDULER_CYCLE,
                    FAILURE_DETECTION)
JOB_RECORDED = (RESTARTS, RESIZES, RESIZE_SECONDS, CHECKPOINT_SAVE, CHECKPOINT_BLOCKED,
                CHECKPOINT_LOAD, CHECKPOINT_BYTES, TOKEN_DENIALS, MEMORY_CHECKPOINT_BYTES)

# -- workers (one endpoint per rank; labels job, rank, node on every series) ----
WORKER_LABELS = ("job", "rank", "node")
WORKER_STEP = _m("kc_worker_step", "gauge", "Optimizer steps this rank has completed",
                 *WORKER_LABELS)
WORKER_STEP_SECONDS = _m("kc_worker_step_seconds", "gauge", "Wall time of this rank's last "
                         "optimizer step", *WORKER_LABELS)
WORKER_TOKENS = _m("kc_worker_tokens_per_second", "gauge", "Tokens this rank trained on per "
                   "second, over its last step", *WORKER_LABELS)
WORKER_SAMPLES = _m("kc_worker_samples_per_second", "gauge", "Samples (sequences) this rank "
                    "trained on per second, over its last step", *WORKER_LABELS)
WORKER_LOSS = _m("kc_worker_loss", "gauge", "This rank's loss at its last step (NaN shows as "
                 "NaN)", *WORKER_LABELS)
WORKER_GRAD_NORM = _m("kc_worker_grad_norm", "gauge", "Global gradient norm at the last step, "
                      "before clipping", *WORKER_LABELS)
WORKER_LR = _m("kc_worker_learning_rate", "gauge", "Learning rate of the last step",
               *WORKER_LABELS)
WORKER_COMM_SHARE = _m("kc_worker_comm_share_ratio", "gauge", "Share of the last step's wall "
                       "time with a collective in flight (over 0.3: communication-bound)",
                       *WORKER_LABELS)
WORKER_COMM_SECONDS = _m("kc_worker_comm_seconds", "gauge", "Wall time of the last step with a "
                         "collective in flight", *WORKER_LABELS)
WORKER_LINK_GBPS = _m("kc_worker_link_gbps", "gauge", "Throughput of this rank's node to the "
                      "control plane's Redis at the job's last link probe, in Gbit/s (set on the "
                      "lowest rank of each node, the one that probes)", *WORKER_LABELS)
WORKER_MEMORY = _m("kc_worker_memory_bytes", "gauge", "Memory of this rank by kind: rss, and "
                   "cuda_allocated and cuda_reserved on a GPU", *WORKER_LABELS, "kind")
WORKER_MFU = _m("kc_worker_mfu_ratio", "gauge", "Model FLOPs utilisation estimate: 6 x params "
                "x tokens/s (plus attention) over the device's peak", *WORKER_LABELS)
WORKER_PEAK_FLOPS = _m("kc_worker_peak_flops", "gauge", "The device peak the MFU estimate "
                       "divides by (catalogue for GPUs, measured once for CPUs)", *WORKER_LABELS)

WORKER = (WORKER_STEP, WORKER_STEP_SECONDS, WORKER_TOKENS, WORKER_SAMPLES, WORKER_LOSS,
          WORKER_GRAD_NORM, WORKER_LR, WORKER_COMM_SHARE, WORKER_COMM_SECONDS, WORKER_LINK_GBPS,
          WORKER_MEMORY, WORKER_MFU, WORKER_PEAK_FLOPS)
CONTROL_PLANE = (JOBS, JOB_INFO, JOB_STATE_AGE, JOB_RECOVERING, JOB_WORLD_SIZE, JOB_STEP, JOB_TOTAL_STEPS,
                 JOB_LOSS, JOB_EVAL_LOSS, *MOE, CHECKPOINT_AGE, HEARTBEAT_AGE, HEARTBEAT_UP,
                 JOB_GOODPUT, JOB_ETTR, CLUSTER_GOODPUT, CLUSTER_ETTR, QUEUE_OLDEST_WAIT,
                 QUEUE_GPUS, CLUSTER_GPUS, NODES, *CLUSTER_RECORDED, *JOB_RECORDED,
                 API_REQUEST, API_AUTH_DENIALS, STORE_UP)
ALL = CONTROL_PLANE + WORKER


# -- the record in Redis ----------------------------------------------------------
# A hash per scope. A field is the JSON of [series name, {label: value}]; the
# value is a float added to with HINCRBYFLOAT, so concurrent recorders never
# lose an increment. A histogram's observation adds to every bucket at or
# above it (Prometheus buckets are cumulative), `_sum` and `_count`.

def _field(series: str, labels: Mapping[str, str]) -> str:
    return json.dumps([series, dict(sorted(labels.items()))], separators=(",", ":"))


def series_field(metric: MetricDef, labels: Mapping[str, str]) -> str:
    """The hash field of one series of a counter or a recorded gauge."""
    return _field(metric.name, {k: str(v) for k, v in labels.items()})


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def increments(metric: MetricDef, value: float, labels: Mapping[str, str]) -> dict[str, float]:
    """The hash fields one `inc` or `observe` adds to, and by how much."""
    labels = {k: str(v) for k, v in labels.items()}
    missing = set(metric.labels) - set(labels)
    if missing or set(labels) - set(metric.labels):
        raise ValueError(f"{metric.name} takes labels {metric.labels}, got {sorted(labels)}")
    if metric.kind == "counter":
        return {_field(metric.name, labels): value}
    if metric.kind != "histogram":
        raise ValueError(f"{metric.name} is a {metric.kind}: gauges are read, not recorded")
    out = {_field(f"{metric.name}_bucket", {**labels, "le": _le(b)}): 1.0
           for b in (*metric.buckets, math.inf) if value <= b}
    out[_field(f"{metric.name}_sum", labels)] = value
    out[_field(f"{metric.name}_count", labels)] = 1.0
    return out


class MetricsRecorder:
    """Records counters and histograms into one hash, best effort.

    A metric must never cost a job: a failed write (Redis away, or an ACL
    that does not allow the key) is logged once and dropped. The store builds
    recorders (`store.recorder()`, `store.recorder(job_id)`) and hands in its
    write: this module never sees a client.
    """

    def __init__(self, write: Callable[[dict[str, float]], None], name: str) -> None:
        self.write, self.name = write, name
        self._warned = False

    def inc(self, metric: MetricDef, value: float = 1.0, **labels: Any) -> None:
        self._add(metric, value, labels)

    def observe(self, metric: MetricDef, value: float, **labels: Any) -> None:
        if value is None or not math.isfinite(value):
            return
        self._add(metric, float(value), labels)

    def set(self, metric: MetricDef, value: float, held: float, **labels: Any) -> None:
        """A recorded gauge (one writer per series: a controller) to `value`, the hash
        holding `held` for it now: adds the difference, as a counter's field is added to."""
        if metric.kind != "gauge" or set(labels) != set(metric.labels):
            log.error("metric not recorded: %s is a %s with labels %s, set with %s", metric.name,
                      metric.kind, metric.labels, sorted(labels))
            return
        if value != held:
            self._write({series_field(metric, labels): float(value) - float(held)})

    def _add(self, metric: MetricDef, value: float, labels: dict[str, Any]) -> None:
        try:
            fields = increments(metric, value, labels)
        except ValueError as exc:  # a recording bug: loud in the log, harmless to the job
            log.error("metric not recorded: %s", exc)
            return
        self._write(fields)

    def _write(self, fields: dict[str, float]) -> None:
        try:
            self.write(fields)
        except Exception as exc:  # noqa: BLE001 -- telemetry is best effort by design
            if not self._warned:
                self._warned = True
                log.warning("could not record metrics to %s: %s", self.name, exc)


# -- reading it back --------------------------------------------------------------
@dataclass
class Sample:
    series: str  # e.g. kc_queue_wait_seconds_bucket
    labels: dict[str, str]
    value: float


def parse_hash(raw: Mapping[Any, Any]) -> list[Sample]:
    """The samples of a recorded hash; fields that do not parse are skipped."""
    out = []
    for f, v in raw.items():
        try:
            series, labels = json.loads(f)
            out.append(Sample(str(series), {str(k): str(x) for k, x in labels.items()}, float(v)))
        except (ValueError, TypeError):
            continue
    return out


def own_job_samples(samples: list[Sample], job_id: str) -> list[Sample]:
    """The samples of job `job_id`'s own hash that may be served as its series.

    The hash lives in the job's key space, which its ranks (the job's own
    code) can write: what they put there is kept only when it is a per-job
    metric (JOB_RECORDED) with exactly that metric's labels and this job's id,
    so that no job can forge another's series or a control-plane one. Pure."""
    allowed: dict[str, set[str]] = {}
    for d in JOB_RECORDED:
        names = ((f"{d.name}_bucket", f"{d.name}_sum", f"{d.name}_count")
                 if d.kind == "histogram" else (d.name,))
        for name in names:
            allowed[name] = set(d.labels) | ({"le"} if name.endswith("_bucket") else set())
    return [s for s in samples if s.labels.get("job") == job_id
            and allowed.get(s.series) == set(s.labels) and math.isfinite(s.value)]


def zero_samples(metric: MetricDef, fixed: Mapping[str, str] | None = None) -> list[Sample]:
    """The series of `metric` that exist at zero: every combination of its `zero`
    label values, with `fixed` labels (e.g. the job) set."""
    fixed = dict(fixed or {})
    combos: list[dict[str, str]] = [dict(fixed)]
    for label in metric.labels:
        if label in fixed:
            continue
        values = metric.zero.get(label)
        if values is None:
            return []  # a label with no known values: series appear when recorded
        combos = [{**c, label: v} for c in combos for v in values]
    out = []
    for labels in combos:
        if metric.kind == "counter":
            out.append(Sample(metric.name, labels, 0.0))
        elif metric.kind == "histogram":
            out += [Sample(f"{metric.name}_bucket", {**labels, "le": _le(b)}, 0.0)
                    for b in (*metric.buckets, math.inf)]
            out += [Sample(f"{metric.name}_sum", labels, 0.0),
                    Sample(f"{metric.name}_count", labels, 0.0)]
    return out


def merge(recorded: Iterable[Sample], zeros: Iterable[Sample]) -> list[Sample]:
    """Recorded samples, plus zero series that were not recorded yet."""
    seen = {}
    for s in zeros:
        seen[(s.series, tuple(sorted(s.labels.items())))] = s
    for s in recorded:
        seen[(s.series, tuple(sorted(s.labels.items())))] = s
    return list(seen.values())
