"""A mixture of experts' routing from the model's `moe_stats()` through rank 0's progress
to the `/metrics` gauges (platform/observability/routing.py, api/server/moe_metrics.py)."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kuangchao.api.server.cluster_metrics import ClusterCollector
from kuangchao.platform.jobs.memory import MemoryStore
from kuangchao.platform.jobs.state import JobRecord, JobState
from kuangchao.platform.observability import metrics as m
from kuangchao.platform.observability.routing import PROGRESS_KEY, RoutingStats, progress_fields

REPORT = {"expert_load": [30, 10, 10, 10], "dropped_tokens": 5, "aux_loss": 1.2, "z_loss": 0.03}


def test_imbalance_is_the_busiest_expert_over_the_mean():
    stats = RoutingStats.parse(REPORT, 4)
    assert stats is not None and stats.imbalance == pytest.approx(30 / 15)
    assert RoutingStats.parse({**REPORT, "expert_load": [0, 0]}).imbalance is None


@pytest.mark.parametrize("bad", [
    None, [], {**REPORT, "expert_load": []}, {**REPORT, "expert_load": "30,10"},
    {**REPORT, "expert_load": [1, float("nan"), 1, 1]}, {**REPORT, "expert_load": [1, -1, 1, 1]},
    {**REPORT, "dropped_tokens": True}, {**REPORT, "aux_loss": ""},
    {k: v for k, v in REPORT.items() if k != "z_loss"}, {**REPORT, "aux_loss": float("inf")},
])
def test_a_malformed_report_is_neither_reported_nor_served(bad):
    assert progress_fields(bad) == {}
    assert RoutingStats.parse(bad, 4) is None


def test_a_load_of_another_length_than_the_specs_experts_is_not_served():
    assert RoutingStats.parse(REPORT, 4) is not None
    assert RoutingStats.parse(REPORT, 3) is None and RoutingStats.parse(REPORT, 5) is None


def test_the_report_round_trips_through_json_progress():
    fields = progress_fields(REPORT)
    assert fields == {PROGRESS_KEY: REPORT}
    assert progress_fields(None) == {}  # a dense model reports nothing


def test_the_built_moe_models_stats_become_progress():
    torch = pytest.importorskip("torch")
    from kuangchao.workers.models.config import ModelConfig
    from kuangchao.workers.models.factory import build_model
    from kuangchao.workers.models.moe import moe_stats

    torch.manual_seed(0)
    cfg = ModelConfig(type="moe", n_layers=1, n_heads=2, d_model=16, seq_len=8, vocab_size=50,
                      n_experts=4, top_k=2, capacity_factor=1.0)
    model = build_model(cfg).train()
    idx = torch.randint(0, 50, (3, 8))
    model(idx, idx)
    stats = RoutingStats.parse(progress_fields(moe_stats(model))[PROGRESS_KEY], 4)
    assert stats is not None
    # Every one of the 24 tokens picks top_k experts, before capacity.
    assert sum(stats.expert_load) == 3 * 8 * 2
    # Capacity 1.0 x the mean: what goes over it is dropped, and nothing else.
    cap = math.ceil(1.0 * 3 * 8 * 2 / 4)
    assert stats.dropped_tokens == sum(max(0, load - cap) for load in stats.expert_load)
    assert stats.imbalance == max(stats.expert_load) / 12
    assert stats.aux_loss > 0 and stats.z_loss > 0


def _scrape(store: MemoryStore) -> dict[str, dict[tuple, float]]:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ClusterCollector(store))
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _job(store: MemoryStore, job_id: str, model: dict) -> None:
    store.create(JobRecord(id=job_id, name=job_id, spec={"model": model}, state=JobState.RUNNING,
                           created_at=1.0, started_at=2.0, world_size=1))


def test_metrics_serve_a_moe_jobs_routing_and_nothing_for_others():
    store = MemoryStore()
    _job(store, "moe", {"type": "moe", "n_experts": 4})
    _job(store, "dense", {"type": "gpt"})
    _job(store, "forged", {"type": "moe", "n_experts": 4})
    _job(store, "quiet", {"type": "moe", "n_experts": 4})  # no logged step yet
    store.set_progress("moe", {"step": 10, "loss": 2.0, **progress_fields(REPORT)})
    store.set_progress("dense", {"step": 10, "loss": 2.0, PROGRESS_KEY: REPORT})
    # Its ranks write the job's progress: 5000 "experts" would be 5000 series.
    store.set_progress("forged", {"step": 1, PROGRESS_KEY: {**REPORT, "expert_load": [1] * 5000}})
    got = _scrape(store)
    load = got[m.JOB_EXPERT_LOAD.name]
    assert load == {(("expert", str(i)), ("job", "moe")): v for i, v in enumerate([30, 10, 10, 10])}
    assert got[m.JOB_EXPERT_IMBALANCE.name] == {(("job", "moe"),): 2.0}
    assert got[m.JOB_MOE_DROPPED.name] == {(("job", "moe"),): 5.0}
    assert got[m.JOB_MOE_AUX_LOSS.name] == {(("job", "moe"),): 1.2}
    assert got[m.JOB_MOE_Z_LOSS.name] == {(("job", "moe"),): 0.03}
    assert got["kc_job_loss"][(("job", "dense"),)] == 2.0  # the dense job's own gauges stay


def test_the_moe_gauges_are_declared_with_bounded_labels():
    for d in m.MOE:
        assert d in m.CONTROL_PLANE and d.kind == "gauge" and d.labels[0] == "job"
    assert m.JOB_EXPERT_LOAD.labels == ("job", "expert")
    assert all(d.labels == ("job",) for d in m.MOE if d is not m.JOB_EXPERT_LOAD)


def test_the_job_json_shows_the_routing_of_a_moe_job_only():
    from kuangchao.platform.control.operations import job_view

    store = MemoryStore()
    _job(store, "moe", {"type": "moe", "n_experts": 4})
    _job(store, "dense", {"type": "gpt"})
    for job_id in ("moe", "dense"):
        store.set_progress(job_id, {"step": 10, "loss": 2.0, PROGRESS_KEY: REPORT})
    moe = job_view(store, store.get("moe"))["progress"]["moe"]
    assert moe == {**REPORT, "imbalance": 2.0}
    assert job_view(store, store.get("dense"))["progress"]["moe"] is None


def test_kc_status_words_the_routing_and_the_plans_ep_and_sp(capsys):
    from kuangchao.api.cli.render import plan_line, print_job

    print_job({"id": "m", "name": "m", "state": "RUNNING", "world_size": 4, "restarts": 0,
               "progress": {"step": 10, "moe": {**REPORT, "imbalance": 2.0}}})
    assert ("experts      imbalance 2.00x over 4 experts, 5 of 60 assignments dropped, "
            "aux loss 1.2, z-loss 0.03") in capsys.readouterr().out
    line = plan_line({"dp": 4, "tp": 2, "pp": 1, "micro_batch": 1, "zero_stage": 3,
                      "expert_parallel_size": 4, "sequence_parallel": True, "gpus": 8, "gpu": "cpu"},
                     None)
    assert "zero=3 ep=4 sp recompute=off" in line
    assert " ep=" not in plan_line({"dp": 4, "expert_parallel_size": 1}, None)
