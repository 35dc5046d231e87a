"""Goodput as shown: the job JSON's `goodput`, `/metrics`' gauges, `GET /v1/goodput`'s
sums and the cache behind them, over the in-memory store."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import TypeAdapter

from kuangchao.api.server.app import create_app
from kuangchao.api.server.cluster_metrics import ClusterCollector
from kuangchao.api.server.dependencies import auth
from kuangchao.api.server.schemas.jobs import ClusterGoodput, GoodputPublic
from kuangchao.platform.control.goodput import GoodputCache, cluster_view, job_goodput
from kuangchao.platform.jobs.memory import MemoryStore
from kuangchao.platform.jobs.state import JobRecord, JobState, admit, finish, start
from kuangchao.platform.security.keystore import KeyStore
from tests.unit.api_fakes import memory_api


def running_job(store: MemoryStore, job_id: str, t0: float) -> JobRecord:
    store.create(JobRecord(id=job_id, name=job_id, spec={}, created_at=t0, world_size=1))
    store.update(job_id, lambda j: admit(j, "admitted"))
    store.update(job_id, lambda j: start(j, "started"))
    return store.get(job_id)


def test_job_goodput_of_a_live_job_adds_up_to_its_age_and_fits_the_job_model():
    store = MemoryStore()
    t0 = time.time() - 2  # admit and start stamp the clock's time
    job = running_job(store, "a-00000001", t0=t0)
    started = job.started_at
    store.add_metrics(job.id, [{"step": 1, "ts": started + 1}, {"step": 10, "ts": started + 10}])
    now = started + 12
    g = job_goodput(store, job, now=now)
    assert g["live"] is True and g["open_cause"] == "productive"
    assert g["wall_s"] == round(now - t0, 3)
    assert abs(g["productive_s"] + sum(g["by_cause"].values()) - g["wall_s"]) < 0.01
    assert 0 < g["ettr"] <= 1
    GoodputPublic.model_validate(json.loads(json.dumps(g)))


def test_job_goodput_is_null_with_a_reason_when_the_records_cannot_be_read():
    class Broken(MemoryStore):
        def metrics(self, job_id, start=0):
            raise TypeError("not a list")

    store = Broken()
    job = running_job(store, "b-00000001", t0=1.0)
    g = job_goodput(store, job, now=5.0)
    assert g["ettr"] is None and g["wall_s"] is None and "could not be split" in g["reason"]
    GoodputPublic.model_validate(g)


def test_metrics_serve_each_active_jobs_split_and_the_cluster_sum():
    store = MemoryStore()
    running_job(store, "m-00000001", t0=1.0)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ClusterCollector(store))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    causes = {s.labels["cause"] for s in fams["kc_job_goodput_seconds"].samples
              if s.labels["job"] == "m-00000001"}
    assert causes == {"productive", "startup", "checkpoint", "detection", "recovery", "redone",
                      "queueing", "preemption", "other"}
    assert [s.labels for s in fams["kc_job_ettr_ratio"].samples] == [{"job": "m-00000001"}]
    wall = sum(s.value for s in fams["kc_cluster_goodput_seconds"].samples)
    per_job = sum(s.value for s in fams["kc_job_goodput_seconds"].samples)
    assert abs(wall - per_job) < 0.01  # the sums are rounded to milliseconds
    assert 0 <= fams["kc_cluster_ettr_ratio"].samples[0].value <= 1


def test_the_cache_keeps_a_finished_split_and_extends_a_live_one():
    store = MemoryStore()
    job = running_job(store, "c-00000001", t0=0.0)
    cache = GoodputCache(max_age_s=60)
    first = cache.get(store, job, now=job.started_at + 5)
    later = cache.get(store, job, now=job.started_at + 15)
    assert later.wall_s - first.wall_s == 10
    store.update(job.id, lambda j: finish(j, "done"))
    done = store.get(job.id)
    assert done.version != job.version
    settled = cache.get(store, done, now=done.finished_at + 100)
    assert settled.wall_s == done.finished_at - 0.0 and not settled.to_json()["live"]


def test_cluster_view_sums_finished_and_active_jobs_apart():
    store = MemoryStore()
    a = running_job(store, "d-00000001", t0=0.0)
    b = running_job(store, "d-00000002", t0=0.0)
    store.update(b.id, lambda j: finish(j, "done"))
    view = cluster_view(store, [a, store.get(b.id)])
    checked = TypeAdapter(ClusterGoodput).validate_python(view)
    assert checked.active.jobs == 1 and checked.finished.jobs == 1 and checked.all.jobs == 2
    assert [row["id"] for row in view["jobs"]] == [a.id, b.id]
    assert view["jobs"][1]["state"] == JobState.SUCCEEDED.value


@pytest.fixture
def api(monkeypatch, tmp_path):
    store = memory_api(monkeypatch, tmp_path)
    clients = {}
    for tenant in ("a", "b"):
        key, _ = KeyStore(store).create(f"user-{tenant}", tenant, "viewer")
        clients[tenant] = TestClient(create_app(), headers={"Authorization": f"Bearer {key}"})
        store.create(JobRecord(id=f"{tenant}-00000001", name=tenant, spec={}, tenant=tenant,
                               created_at=time.time() - 10))
    yield store, clients
    auth._trail.cache_clear()


def test_goodput_is_shown_only_to_callers_who_may_read_the_job(api):
    _, clients = api
    own = clients["a"].get("/v1/jobs/a-00000001")
    assert own.status_code == 200, own.text
    g = own.json()["goodput"]
    assert g["by_cause"]["queueing"] > 0 and g["open_cause"] == "queueing"
    assert clients["a"].get("/v1/jobs/b-00000001").status_code == 404
    summed = clients["a"].get("/v1/goodput")
    assert summed.status_code == 200, summed.text
    assert [row["id"] for row in summed.json()["jobs"]] == ["a-00000001"]
    assert summed.json()["all"]["jobs"] == 1
    listed = clients["a"].get("/v1/jobs").json()["jobs"]
    assert "goodput" not in listed[0]  # a listing leaves it out
    assert clients["a"].get("/v1/goodput?limit=0").status_code == 422


def test_a_failure_event_carries_the_step_rank_0_had_reached():
    from kuangchao.platform.execution.recovery import Failure, write_failure

    store = MemoryStore()
    job = running_job(store, "f-00000001", t0=time.time())
    store.set_progress(job.id, {"step": 70, "updated_at": 123.5})
    assert write_failure(store, job.id, Failure("died", "rank 1 died", rank=1), None, None)
    failure = next(e for e in store.events(job.id) if e["type"] == "failure")
    assert (failure["progress_step"], failure["progress_at"]) == (70, 123.5)


def test_kc_nodes_counts_a_draining_node_apart_and_its_gpus_out_of_capacity():
    store = MemoryStore()
    store.set_info("nodes", {"nodes": [
        {"name": "n0", "gpus": 4, "alive": True},
        {"name": "n1", "gpus": 4, "alive": True, "draining": True, "drain_deadline": 9e9},
        {"name": "n2", "gpus": 4, "alive": False}], "updated_at": 1.0})
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ClusterCollector(store))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    nodes = {s.labels["status"]: s.value for s in fams["kc_nodes"].samples}
    assert nodes == {"alive": 1, "lost": 1, "quarantined": 0, "draining": 1}
    gpus = {s.labels["kind"]: s.value for s in fams["kc_cluster_gpus"].samples}
    assert gpus["total"] == 4
