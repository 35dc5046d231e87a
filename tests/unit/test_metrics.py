"""The metric catalogue, its Redis record, file_sd groups, and a rank's timing."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kuangchao.api.server.cluster_metrics import recorded_families
from kuangchao.platform.jobs.memory import MemoryStore
from kuangchao.platform.jobs.state import JobRecord, JobState, PlacedRank
from kuangchao.platform.observability import metrics as m
from kuangchao.platform.observability.scrape_targets import groups, write_file_sd
from kuangchao.workers.parallel.comm_clock import CommClock
from kuangchao.workers.parallel.comm_hooks import timed_allreduce_hook
from kuangchao.workers.runtime.telemetry import WorkerTelemetry


def test_every_name_is_prefixed_unique_and_carries_its_unit():
    names = [d.name for d in m.ALL]
    assert len(names) == len(set(names))
    units = ("_seconds", "_bytes", "_total", "_ratio", "_per_second", "_flops")
    for d in m.ALL:
        assert re.fullmatch(r"kc_[a-z0-9_]+", d.name), d.name
        if d.kind == "counter":
            assert d.name.endswith("_total"), d.name
        if d.kind == "histogram":
            assert d.name.endswith(("_seconds", "_bytes")), d.name
        assert d.help and d.kind in ("counter", "gauge", "histogram")
        if "_seconds" in d.name or "_bytes" in d.name or "_ratio" in d.name:
            assert d.name.endswith(units), d.name


def test_worker_series_carry_job_rank_and_node():
    for d in m.WORKER:
        assert d.labels[:3] == ("job", "rank", "node"), d.name


def test_a_histogram_observation_fills_cumulative_buckets():
    inc = m.increments(m.QUEUE_WAIT, 0.3, {"queue": "q"})
    samples = m.parse_hash({k: str(v) for k, v in inc.items()})
    buckets = {s.labels["le"]: s.value for s in samples if s.series.endswith("_bucket")}
    assert "0.25" not in buckets  # below the value: not incremented
    assert buckets["0.5"] == buckets["+Inf"] == 1.0
    by_series = {s.series: s.value for s in samples}
    assert by_series["kc_queue_wait_seconds_sum"] == 0.3
    assert by_series["kc_queue_wait_seconds_count"] == 1.0


def test_labels_must_match_the_declaration():
    with pytest.raises(ValueError, match="takes labels"):
        m.increments(m.RESTARTS, 1, {"job": "j"})
    with pytest.raises(ValueError, match="gauges are read"):
        m.increments(m.JOBS, 1, {"state": "QUEUED", "queue": "q"})


def test_recorded_counters_and_histograms_render_as_prometheus_text():
    store = MemoryStore()
    rec = store.recorder()
    rec.observe(m.FAILURE_DETECTION, 2.0, cause="died")
    rec.observe(m.FAILURE_DETECTION, 4.0, cause="died")
    rec.observe(m.FAILURE_DETECTION, float("nan"), cause="died")  # dropped, not a NaN sum
    job = store.recorder("j1")
    job.inc(m.RESTARTS, cause="died", job="j1")
    samples = m.parse_hash(store.metric_fields()) + m.parse_hash(store.metric_fields("j1"))
    zeros = m.zero_samples(m.FAILURE_DETECTION) + m.zero_samples(m.RESTARTS, {"job": "j1"})
    text = _render(recorded_families(m.merge(samples, zeros)))
    values = _values(text)
    assert values[("kc_failure_detection_seconds_count", (("cause", "died"),))] == 2
    assert values[("kc_failure_detection_seconds_sum", (("cause", "died"),))] == 6.0
    assert values[("kc_failure_detection_seconds_bucket", (("cause", "died"), ("le", "2.5")))] == 1
    assert values[("kc_failure_detection_seconds_count", (("cause", "hung"),))] == 0  # zero series
    assert values[("kc_job_restarts_total", (("cause", "died"), ("job", "j1")))] == 1
    assert values[("kc_job_restarts_total", (("cause", "hung"), ("job", "j1")))] == 0


def test_a_failed_record_never_raises(caplog):
    def away(fields):
        raise ConnectionError("redis is away")

    rec = m.MetricsRecorder(away, "k")
    rec.inc(m.RESTARTS, cause="died", job="j")  # Redis away: logged once, dropped
    rec.inc(m.RESTARTS, cause="died", job="j")
    assert caplog.text.count("could not record metrics to k") == 1
    store = MemoryStore()
    store.recorder().inc(m.RESTARTS, cause="died")  # a recording bug: logged
    assert store.metric_fields() == {} and "metric not recorded" in caplog.text


def test_zero_series_need_every_label_known():
    assert m.zero_samples(m.QUEUE_WAIT) == []  # queues are known only at scrape time
    assert len(m.zero_samples(m.QUEUE_WAIT, {"queue": "q"})) == len(m.QUEUE_WAIT.buckets) + 3


def _render(families) -> str:
    class _C:
        def collect(self):
            yield from families
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_C())
    return generate_latest(reg).decode()


def _values(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _job(job_id: str, state: JobState, world: int) -> JobRecord:
    # Placed for world + 1 ranks: a shrink leaves the last one beyond the world size.
    placement = tuple(PlacedRank(rank=r, node="n0", node_id="id0", leaf="l0")
                      for r in range(world + 1))
    return JobRecord(id=job_id, name=job_id, spec={}, state=state, world_size=world,
                     placement=placement)


def test_file_sd_groups_keep_current_ranks_of_running_jobs_only():
    entry = lambda addr: json.dumps({"addr": addr, "node": "n0", "pid": 1})  # noqa: E731
    jobs = [_job("a", JobState.RUNNING, 2), _job("b", JobState.QUEUED, 2)]
    registered = {"a": {"0": entry("10.0.0.1:8001"), "1": entry("10.0.0.1:8002"),
                        "2": entry("10.0.0.1:8003"), "x": "bad"},
                  "b": {"0": entry("10.0.0.1:8009")}}
    out = groups(jobs, registered, {"id0": "10.0.0.1"})
    assert out == [
        {"targets": ["10.0.0.1:8001"], "labels": {"job": "a", "rank": "0", "node": "n0"}},
        {"targets": ["10.0.0.1:8002"], "labels": {"job": "a", "rank": "1", "node": "n0"}}]


def test_file_sd_is_replaced_atomically_and_only_on_change(tmp_path):
    path = tmp_path / "sd" / "kc-workers.json"
    data = [{"targets": ["h:1"], "labels": {"job": "a"}}]
    assert write_file_sd(path, data) is True
    assert json.loads(path.read_text()) == data
    assert write_file_sd(path, data) is False
    assert write_file_sd(path, []) is True and json.loads(path.read_text()) == []
    assert [p.name for p in path.parent.iterdir()] == ["kc-workers.json"]


def test_comm_clock_counts_overlapping_spans_once():
    clock = CommClock()
    clock.add(1.0, 2.0)
    clock.add(1.5, 2.5)
    clock.add(4.0, 6.0)  # runs past the step: counted up to its end, kept for the next
    assert clock.busy_within(0.0, 5.0) == pytest.approx(2.5)
    assert clock.busy_within(5.0, 7.0) == pytest.approx(1.0)


def test_telemetry_derives_rates_and_mfu_from_one_step():
    tel = WorkerTelemetry("j", 0, "n0")
    tel.flops_per_token, tel.peak = 1e6, 1e9
    tel.begin_step()
    tel.clock.add(tel._step_start, tel._step_start)  # an empty span changes nothing
    tel.observe_numerics(2.5, float("nan"), 1e-3)
    tel.end_step(7, samples=4, tokens=256)
    v = _values(_render(tel.collect()))
    lab = ()  # job, rank and node are the scrape target's labels, not served by the rank
    took = v[("kc_worker_step_seconds", lab)]
    assert v[("kc_worker_step", lab)] == 7
    assert v[("kc_worker_tokens_per_second", lab)] == pytest.approx(256 / took)
    assert v[("kc_worker_samples_per_second", lab)] == pytest.approx(4 / took)
    assert v[("kc_worker_mfu_ratio", lab)] == pytest.approx(1e6 * 256 / took / 1e9)
    assert math.isnan(v[("kc_worker_grad_norm", lab)])
    rss = (("kind", "rss"),)
    assert v[("kc_worker_memory_bytes", rss)] > 1e6


def test_the_timed_ddp_hook_averages_and_records(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    ddp = None
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        ref = torch.nn.Linear(8, 4)
        ref.load_state_dict(model.state_dict())
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        clock = CommClock()
        ddp.register_comm_hook(None, timed_allreduce_hook(clock))
        x = torch.randn(16, 8)
        ddp(x).sum().backward()
        ref(x).sum().backward()
        assert torch.equal(model.weight.grad, ref.weight.grad)
        assert clock._spans, "the all-reduce was not timed"
    finally:
        # DDP's reducer holds the group; freed after it, gloo's destructor can hang
        # joining its threads, so the reducer goes first.
        ddp = None
        dist.destroy_process_group()


def test_a_jobs_hash_serves_only_its_own_per_job_series():
    """The hash is in the job's key space, which its ranks can write: a rank that
    records another job's restarts, or a control-plane series, is not served."""
    fields = {}
    fields.update(m.increments(m.RESTARTS, 1, {"job": "a", "cause": "node_lost"}))
    fields.update(m.increments(m.CHECKPOINT_SAVE, 0.5, {"job": "a"}))
    forged = {json.dumps(["kc_job_restarts_total", {"job": "b", "cause": "node_lost"}]): 7,
              json.dumps(["kc_store_up", {"job": "a"}]): 0,
              json.dumps(["kc_job_restarts_total", {"job": "a", "cause": "x", "tenant": "t"}]): 1,
              json.dumps(["kc_job_resizes_total", {"job": "a"}]): "nan"}
    kept = m.own_job_samples(m.parse_hash({**fields, **forged}), "a")
    assert {s.series for s in kept} == {"kc_job_restarts_total", "kc_checkpoint_save_seconds_bucket",
                                        "kc_checkpoint_save_seconds_sum",
                                        "kc_checkpoint_save_seconds_count"}
    assert all(s.labels["job"] == "a" and "tenant" not in s.labels for s in kept)
    assert m.own_job_samples(m.parse_hash(fields), "b") == []


def test_the_job_gauges_serve_train_and_eval_loss_from_the_jobs_progress():
    from kuangchao.api.server.cluster_metrics import ClusterCollector

    store = MemoryStore()
    for job_id in ("ev", "tr"):
        store.create(JobRecord(id=job_id, name=job_id, spec={}, state=JobState.RUNNING,
                               created_at=1.0, world_size=1))
    store.set_progress("ev", {"step": 20, "loss": 2.5, "eval_loss": 2.75})
    store.set_progress("tr", {"step": 3, "loss": 3.0, "eval_loss": None})  # not evaluated yet
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ClusterCollector(store))
    text = generate_latest(reg).decode()
    assert "# HELP kc_job_eval_loss Mean loss on the held-out split" in text
    assert 'kc_job_eval_loss{job="ev"} 2.75' in text and 'kc_job_loss{job="ev"} 2.5' in text
    assert 'kc_job_loss{job="tr"} 3.0' in text and 'kc_job_eval_loss{job="tr"}' not in text
