"""The API's response models: /openapi.json documents every answer, and a route's
model passes the JSON its view builds through unchanged: no key dropped or added,
no value coerced, and, for the views this API builds, keys in the same order (a
document another component wrote comes back with its declared keys first)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, get_args

import pytest
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError

from kuangchao.api.server.app import ROUTERS, app, create_app
from kuangchao.api.server.dependencies import store as deps
from kuangchao.api.server.schemas.jobs import JobPublic, JobStateName
from kuangchao.platform.control import operations
from kuangchao.platform.jobs.state import JobRecord, JobState, PlacedRank
from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.security.apikeys import PERMISSIONS, Principal
from kuangchao.platform.spec.jobspec import validate_spec


def api_routes() -> list[APIRoute]:
    """Every route: the routers' and the app's own (`/metrics`, `/openapi.json`)."""
    # The app keeps included routers as lazy wrappers; the routers hold the routes.
    routes = [r for router in ROUTERS for r in router.routes] + list(app.router.routes)
    return [r for r in routes if isinstance(r, APIRoute)]


def operations_of(doc: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(method.upper(), path, op) for path, ops in doc["paths"].items()
            for method, op in ops.items()]


def resolve(doc: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    return doc["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else schema


def test_openapi_documents_a_schema_for_every_operations_success():
    doc = app.openapi()
    ops = operations_of(doc)
    assert len(ops) >= 20, "the schema lost its operations"
    for method, path, op in ops:
        ok = {code: r for code, r in op["responses"].items() if code.startswith("2")}
        assert ok, f"{method} {path} documents no 2xx answer"
        for code, response in ok.items():
            content = response.get("content")
            assert content, f"{method} {path} {code} documents no content"
            for media, body in content.items():
                schema = resolve(doc, body.get("schema") or {})
                assert schema.get("type") or schema.get("anyOf") or schema.get("oneOf"), (
                    f"{method} {path} {code} {media}: the schema is empty ({body})")


def test_building_the_app_and_its_schema_opens_no_store(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("the app reached for Redis")

    monkeypatch.setattr(JobStore, "from_url", refuse)
    monkeypatch.setattr(deps, "open_store", refuse)
    assert create_app().openapi()["paths"]


def test_openapi_documents_our_validation_error_not_fastapis():
    doc = app.openapi()
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    problem = doc["components"]["schemas"]["FieldProblem"]
    assert problem["required"] == ["loc", "msg", "field"]
    for method, path, op in operations_of(doc):
        if op.get("parameters") or op.get("requestBody") or path == "/v1/jobs":
            assert "422" in op["responses"], f"{method} {path} does not document its 422"


def test_every_json_route_has_a_response_model():
    routes = [r for r in api_routes() if r.include_in_schema]
    assert len(routes) == len(operations_of(app.openapi()))
    for route in routes:
        if route.include_in_schema:
            declared_content = any("content" in r for r in route.responses.values())
            assert route.response_model is not None or declared_content, (
                f"{route.path} has no response model")
            assert route.response_model not in (dict, list, Any), route.path


def test_job_state_names_are_the_state_machines_states():
    assert set(get_args(JobStateName)) == {s.value for s in JobState}


def same_json(a: Any, b: Any, ordered: bool) -> bool:
    """Equal as JSON documents, types included (1 is not 1.0); key order too if `ordered`."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        keys_match = list(a) == list(b) if ordered else set(a) == set(b)
        return keys_match and all(same_json(a[k], b[k], ordered) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_json(x, y, ordered) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def answer(path: str, method: str, content: Any) -> Any:
    """What the route at `path` sends for `content`, through its own response model."""
    route = next(r for r in api_routes() if r.path == path and method in r.methods)
    adapter: TypeAdapter[Any] = TypeAdapter(route.response_model)
    return json.loads(adapter.dump_json(adapter.validate_python(content),
                                        exclude_unset=route.response_model_exclude_unset))


def assert_passes_unchanged(path: str, method: str, content: Any, ordered: bool = True) -> None:
    sent = answer(path, method, content)
    assert same_json(sent, json.loads(json.dumps(content)), ordered), f"{sent}\n!=\n{content}"


class FakeStore:
    """What the views read, held in dicts."""

    def __init__(self, progress=None, checkpoints=None, info=None, active=(), quarantine=None):
        self._progress, self._checkpoints = progress or {}, checkpoints or []
        self._info, self._active, self._quarantine = info or {}, list(active), quarantine or {}

    def progress(self, job_id):
        return dict(self._progress)

    def checkpoints(self, job_id):
        return list(self._checkpoints)

    def info(self, name):
        return self._info.get(name)

    def list_active(self):
        return self._active

    def quarantine(self):
        return self._quarantine


SPEC = validate_spec({"task": {"name": "t"}, "elastic": {"min_replicas": 1, "max_replicas": 2},
                      "parallel": {"data_parallel_size": 2}}).model_dump(mode="json")
RUNNING = JobRecord(
    id="t-000000000001", name="t", spec=SPEC, state=JobState.RUNNING, started_at=100.5,
    restarts=1, restart_log=({"at": 99.0, "reason": "rank 1 died"},), owner="ana",
    placement=(PlacedRank(0, "n0", "id0", "l0", gpu=0, pid=41, gpus=(0,)),
               PlacedRank(1, "n0", "id0", "l0", gpus=(1,))),
    replicas=2, resize={"to": 2}, message="resumed", state_since=101, plan={"dp": 2})


@pytest.mark.parametrize("job, store", [
    (JobRecord(id="q-000000000001", name="q", spec=SPEC), FakeStore()),
    (RUNNING, FakeStore(progress={"step": 7, "total_steps": 10, "loss": 2, "step_s": 0.25,
                                  "initial_loss": 3.5, "updated_at": 1.0},
                        checkpoints=[{"step": 5, "path": "/c/5", "bytes": 10, "blocked_s": 0.0,
                                      "write_s": 0.1, "committed_at": 3.0},
                                     {"step": 6, "path": "/c/6", "by": "an older rank"}])),
], ids=["queued", "running"])
def test_job_routes_send_the_job_view_unchanged(job, store):
    view = operations.job_view(store, job, [job])
    for path, method in [("/v1/jobs/{job_id}", "GET"), ("/v1/jobs/{job_id}/cancel", "POST"),
                         ("/v1/jobs/{job_id}", "PATCH"), ("/v1/jobs", "POST")]:
        assert_passes_unchanged(path, method, view)
    assert_passes_unchanged("/v1/jobs", "GET", {"jobs": [view, view]})


def test_job_model_declares_every_field_of_the_record():
    record = {f.name for f in dataclasses.fields(JobRecord)} - {"version"}
    assert record <= set(JobPublic.model_fields)


def test_job_model_refuses_a_field_it_does_not_declare():
    view = operations.job_view(FakeStore(), RUNNING, [RUNNING])
    with pytest.raises(ValidationError, match="new_field"):
        JobPublic.model_validate({**view, "new_field": 1})


def test_job_model_refuses_a_coerced_value():
    view = operations.job_view(FakeStore(), RUNNING, [RUNNING])
    with pytest.raises(ValidationError, match="priority"):
        JobPublic.model_validate({**view, "priority": 50.0})


def test_stream_routes_pass_free_form_entries_and_omitted_keys_through():
    events = {"events": [{"ts": 1.0, "type": "state", "from": "QUEUED", "to": "PLACING",
                          "message": "admitted"},
                         {"ts": 2, "type": "failure", "rank": 1, "detail": {"exit": -9}}],
              "next": 2}
    assert_passes_unchanged("/v1/jobs/{job_id}/events", "GET", events, ordered=False)
    logs = {"logs": [{"message": "a line"},
                     {"ts": 1.5, "level": "INFO", "job_id": "j", "rank": 0, "module": "train",
                      "message": "step 1", "step": 1}], "next": 5}
    assert_passes_unchanged("/v1/jobs/{job_id}/logs", "GET", logs, ordered=False)
    points = {"points": [{"step": 1, "ts": 1.0, "loss": 2, "tokens_per_s": None, "grad_norm": 0.5}],
              "next": 1}
    assert_passes_unchanged("/v1/jobs/{job_id}/metrics", "GET", points, ordered=False)
    samples = {"record_samples": True, "samples": {"0/0/0": "0:4"}}
    assert_passes_unchanged("/v1/jobs/{job_id}/samples", "GET", samples)


NODES = {"nodes": [{"name": "n0", "node_id": "id0", "gpus": 2, "nvlink": [[0, 1]], "leaf": "l0",
                    "spine": None, "cpus": 16.0, "alive": True, "pinned_gpus": False,
                    "accelerator": None},
                   {"name": "n1", "gpus": 1, "leaf": "l0", "nvlink": [[0]], "alive": True}],
         "updated_at": 5.0}


def test_node_route_sends_the_node_view_unchanged():
    job = dataclasses.replace(RUNNING, tenant="other")
    store = FakeStore(info={"nodes": NODES}, active=[RUNNING, job],
                      quarantine={"n1": {"since": 1.0, "until": 4e9, "failures": 3,
                                         "reason": "crashes"}})
    view = operations.node_view(store, lambda t: t == "default")
    assert_passes_unchanged("/v1/nodes", "GET", view, ordered=False)
    assert list(answer("/v1/nodes", "GET", view)["nodes"][0]) == list(view["nodes"][0])


def test_queue_routes_send_the_queue_view_unchanged():
    table = {"queues": [{"name": "default", "guaranteed_gpus": 0, "borrow_limit_gpus": None},
                        {"name": "research", "guaranteed_gpus": 4, "borrow_limit_gpus": 2}],
             "preemption": False, "policy": "gang"}
    view = operations.queue_view(FakeStore(info={"queues": table}, active=[RUNNING]))
    assert_passes_unchanged("/v1/queues", "GET", view)
    assert_passes_unchanged("/v1/queues", "PUT", view)


def test_key_routes_send_the_principal_unchanged():
    who = Principal("k1", "ana", "default", "viewer", created_at=1.5, expires_at=10)
    assert_passes_unchanged("/v1/admin/keys", "POST", {"key": "kc_k1_s", **who.to_json()})
    assert_passes_unchanged("/v1/admin/keys", "GET", {"keys": [who.to_json()]})
    assert_passes_unchanged("/v1/admin/keys/{key_id}", "DELETE", who.to_json())
    assert_passes_unchanged("/v1/whoami", "GET",
                            {**who.to_json(), "permissions": sorted(PERMISSIONS[who.role])})


def test_debug_route_sends_each_kind_of_report_unchanged():
    answers = {0: {"groups": [{"name": "dp", "ranks": [0, 1]}], "pending": None}}
    for kind, report in [
        ("comm", {"ranks": answers, "problems": [], "healthy": True}),
        ("comm", {"ranks": answers, "problems": [], "healthy": True, "slow_links": [
            {"node": "node-3", "gbps": 0.05, "best_gbps": 2, "at": 1.5},
            {"node": "node-4", "gbps": None, "best_gbps": None, "at": None}]}),
        ("memory", {"ranks": answers}),
        ("gradient", {"ranks": 0, "step": None, "max_divergence": 0.0, "diverged": [],
                      "identical": True, "errors": {}}),
        ("gradient", {"ranks": 2, "step": 3, "steps_agree": True, "params": 1,
                      "max_divergence": 0.5, "identical": False,
                      "diverged": [{"param": "w", "divergence": 0.5, "rank": 1, "norm_rank0": 1.0,
                                    "norm_rank": 1.5}], "errors": {1: "boom"}}),
    ]:
        content = {"job": "j", "kind": kind, "request": "r1", "missing": [1], **report}
        # The report of no answers lists `identical` and `diverged` the other way round.
        assert_passes_unchanged("/v1/jobs/{job_id}/debug/{kind}", "POST", content, ordered=False)
    assert_passes_unchanged("/v1/jobs/{job_id}/profiles", "POST",
                            {"job": "j", "id": "0123456789ab", "steps": 5, "ranks": 2})
    assert_passes_unchanged("/v1/jobs/{job_id}/profiles/{profile_id}", "GET", {
        "job": "j", "id": "0123456789ab", "ranks": {0: {"summary": "ok"}, 1: {"error": "no"}},
        "missing": [], "done": True, "files": ["rank0.json.gz"]})


def test_health_and_audit_routes_send_their_documents_unchanged():
    assert_passes_unchanged("/healthz", "GET", {"status": "ok", "version": "1.0"})
    record = {"principal": "ana[default/k1]", "action": "job.cancel", "resource": "job/j",
              "decision": "allow", "reason": "", "job": "j", "ts": 1.0}
    assert_passes_unchanged("/v1/audit", "GET", {"records": [record, {**record, "extra": 1}]})
    group = {"targets": ["10.0.0.1:9100"], "labels": {"job": "j", "rank": "0", "node": "n0"}}
    assert_passes_unchanged("/v1/metrics/targets", "GET", [group])
