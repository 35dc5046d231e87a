"""The Python SDK (`kuangchao.api.sdk.client.Client`) against the live API of the
session's `kc up` stack."""

from __future__ import annotations

import json
import uuid

import pytest

from kuangchao.api.sdk.client import ApiError, Client, load_file
from kuangchao.api.sdk.types import Event, Job, LogLine, MetricPoint
from kuangchao.platform.errors import SpecError

from .conftest import ROOT, wait_for

pytestmark = pytest.mark.integration
SMALL = ["model.d_model=32", "model.n_layers=1", "data.max_bytes=200000",
         "training.steps=12", "training.log_interval=3", "checkpoint.interval_steps=6"]


@pytest.fixture(scope="module")
def sdk(stack) -> Client:
    with Client(stack.state["api_url"], stack.key) as c:
        yield c


@pytest.fixture(scope="module")
def finished(sdk, stack) -> Job:
    """examples/tiny-gpt.yaml, shrunk, submitted by path and followed to its end."""
    seen: list[str] = []
    name = f"sdk-{uuid.uuid4().hex[:6]}"
    job = sdk.submit(ROOT / "examples" / "tiny-gpt.yaml", wait=True, timeout=600,
                     sets=[*SMALL, f"task.name={name}",
                           f"checkpoint.path={stack.env['KC_HOME']}/sdk-ckpt"],
                     on_update=lambda j: seen.append(j.state))
    assert seen and seen[-1] == job.state and "SUCCEEDED" not in seen[:-1]
    return job


def test_submit_by_path_waits_and_returns_a_typed_job(finished):
    assert isinstance(finished, Job) and finished.succeeded and finished.is_terminal
    assert finished.progress.step == 12 == finished.progress.total_steps
    assert finished.progress.loss < finished.progress.initial_loss
    assert finished["state"] == finished.state  # still the JSON: kc and json.dumps use it
    assert json.loads(json.dumps(finished))["id"] == finished.id
    assert [p.rank for p in finished.placement] == list(range(finished.world_size))
    assert all(p.node and p.gpus for p in finished.placement)
    assert [c.step for c in finished.checkpoints][-1] == 12
    # Where its time went: productive steps and the causes add up to its wall-clock time.
    g = finished.goodput
    assert g is not None and 0 < g.ettr < 1
    wall = finished["finished_at"] - finished["created_at"]
    assert g.wall_s == pytest.approx(wall, rel=0.01)
    assert g.productive_s + sum(g.by_cause.values()) == pytest.approx(wall, rel=0.01)
    assert g.by_cause["redone"] == g.by_cause["detection"] == 0


def test_get_and_list_filter_by_state_and_queue(sdk, finished):
    assert sdk.get(finished.id) == finished
    done = sdk.list(state="SUCCEEDED")
    assert finished.id in {j.id for j in done} and all(j.state == "SUCCEEDED" for j in done)
    assert finished.id not in {j.id for j in sdk.list(state="RUNNING")}
    assert finished.id in {j.id for j in sdk.list(queue=finished.queue)}
    assert not sdk.list(queue="no-such-queue")


def test_events_logs_and_metrics_page_with_cursors(sdk, finished):
    events = sdk.events(finished.id)
    assert all(isinstance(e, Event) for e in events.entries)
    states = [e["to"] for e in events.entries if e.type == "state"]
    assert states[-1] == "SUCCEEDED" and "RUNNING" in states
    assert sdk.events(finished.id, start=events.next).entries == []
    logs = sdk.logs(finished.id, rank=0)
    assert logs.entries and all(isinstance(x, LogLine) and x.rank == 0 for x in logs.entries)
    assert any("loss" in x.message for x in logs.entries)
    curve = sdk.metrics(finished.id)
    assert all(isinstance(p, MetricPoint) for p in curve.entries)
    # One point per logged step: the first, every log_interval (3), and the last.
    assert [p.step for p in curve.entries] == [1, 3, 6, 9, 12]
    assert curve.entries[-1].loss == pytest.approx(finished.progress.loss)
    assert sdk.metrics(finished.id, start=curve.next).entries == []
    tail = sdk.metrics(finished.id, start=3)
    assert [p.step for p in tail.entries] == [9, 12] and tail.next == curve.next


def test_cancel_and_scale_answer_typed_or_refuse_with_the_reason(sdk, stack):
    job = sdk.submit(stack.job_doc(task={"name": "sdk-cancel"}, training__steps=100000,
                                   elastic={"min_replicas": 1, "max_replicas": 2}))
    wait_for(lambda: sdk.get(job.id).state == "RUNNING", 300, "the job to run")
    scaled = sdk.scale(job.id, 1)
    assert isinstance(scaled, Job) and scaled["desired_replicas"] == 1
    with pytest.raises(ApiError) as err:
        sdk.scale(job.id, 99)
    assert err.value.status == 422 and "replicas" in err.value.describe()
    cancelled = sdk.cancel(job.id)
    assert isinstance(cancelled, Job)
    assert sdk.wait(job.id, timeout=300).state == "CANCELLED"
    with pytest.raises(ApiError) as err:
        sdk.cancel(job.id)
    assert err.value.status == 409


def test_bad_specs_come_back_with_field_paths(sdk, tmp_path):
    with pytest.raises(ApiError) as err:
        sdk.submit({"task": {"name": "x"}, "training": {"steps": -1}, "bogus": 1})
    fields = {d["field"] for d in err.value.detail}
    assert err.value.status == 422 and {"training.steps", "bogus"} <= fields
    with pytest.raises(ApiError) as err:
        sdk.validate("training:\n  steps: 0\n")
    assert "training.steps" in err.value.describe()
    with pytest.raises(ApiError) as err:  # text has no folder to resolve `extends:` from
        sdk.validate((ROOT / "examples" / "tiny-gpt.yaml").read_text())
    assert err.value.status == 422 and "extends" in err.value.describe()
    ok = sdk.validate(load_file(ROOT / "examples" / "tiny-gpt.yaml", ["training.steps=7"]))
    assert ok["valid"] and ok["spec"]["training"]["steps"] == 7 and ok["plan"] is None
    with pytest.raises(SpecError):
        sdk.submit(tmp_path / "missing.yaml")
    with pytest.raises(ApiError) as err:
        sdk.get("no-such-job")
    assert err.value.status == 404


def test_a_wrong_address_or_key_is_an_api_error_not_a_traceback(stack):
    with pytest.raises(ApiError) as err:
        Client("http://127.0.0.1:9", stack.key).list()
    assert err.value.status == 0 and "KC_API_URL" in err.value.describe()
    with pytest.raises(ApiError) as err:
        Client(stack.state["api_url"], "kc_0000000000000000_" + "x" * 43).list()
    assert err.value.status == 401
