"""The API's edge (api/server/edge.py) and what a submitter with only a key can
send: a stranger's body is never parsed, bodies are bounded, ids that are no
job ids answer as missing jobs, alias bombs are refused in milliseconds, and a
flood of refusals cannot flush the audit trail. In process, on the in-memory
store."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from kuangchao.api.server import edge
from kuangchao.api.server.app import create_app
from kuangchao.api.server.dependencies import auth
from kuangchao.platform.security.audit import DenialSampler
from kuangchao.platform.security.keystore import KeyStore
from tests.unit.api_fakes import memory_api

SPEC = {"task": {"name": "edge"}, "model": {"n_layers": 1, "n_heads": 2, "d_model": 32,
                                             "seq_len": 32},
        "parallel": {"data_parallel_size": 1}, "training": {"steps": 5}}


@pytest.fixture
def api(monkeypatch, tmp_path):
    store = memory_api(monkeypatch, tmp_path)
    monkeypatch.setattr(auth, "_denials", DenialSampler(burst=5, window_s=3600))
    key, _ = KeyStore(store).create("alice", "team-a", "submitter")
    client = TestClient(create_app())
    client.headers["Authorization"] = f"Bearer {key}"
    stranger = TestClient(create_app())
    yield store, client, stranger
    auth._trail.cache_clear()


def audit_records(store) -> list[dict]:
    return [json.loads(line) for line in store.audit_lines(None)]


@pytest.mark.parametrize(("method", "path", "body"), [
    ("PUT", "/v1/queues", b"{"),
    ("POST", "/v1/jobs", b"{not yaml: ["),
    ("PATCH", "/v1/jobs/x-00000000", b"[]"),
    ("POST", "/v1/admin/keys", b"\xff"),
    ("GET", "/v1/no-such-route", b""),
])
def test_a_stranger_gets_401_before_the_body_or_route_is_looked_at(api, method, path, body):
    store, _, stranger = api
    resp = stranger.request(method, path, content=body)
    assert resp.status_code == 401, resp.text
    assert "missing: send the API key" in resp.json()["detail"]
    assert resp.headers["www-authenticate"] == "Bearer"
    (rec,) = audit_records(store)
    assert rec["decision"] == "deny" and rec["resource"] == f"{method} {path}"


def test_public_paths_need_no_key(api):
    _, _, stranger = api
    assert stranger.get("/healthz").status_code == 200
    assert stranger.get("/ui/").status_code == 200


def test_a_body_over_the_limit_gets_413_unread_and_nothing_is_stored(api, monkeypatch):
    store, client, _ = api
    big = b"#" * (edge.DEFAULT_MAX_BODY_BYTES + 1)
    resp = client.post("/v1/jobs", content=big)
    assert resp.status_code == 413 and "KC_API_MAX_BODY_BYTES" in resp.json()["detail"]

    def chunks():  # no Content-Length: sent chunked
        for _ in range(5):
            yield b"#" * (edge.DEFAULT_MAX_BODY_BYTES // 4)
    resp = client.post("/v1/jobs", content=chunks())
    assert resp.status_code == 413
    assert store.list() == []
    # Under the limit, chunked or not, a body reaches the route whole.
    small = json.dumps(SPEC).encode()
    assert client.post("/v1/jobs", content=iter([small[:20], small[20:]])).status_code == 201
    assert client.post("/v1/jobs", content=small).status_code == 201
    assert len(store.list()) == 2


def test_a_bad_limit_setting_says_what_to_change(monkeypatch):
    from kuangchao.platform.errors import KuangchaoError

    monkeypatch.setenv("KC_API_MAX_BODY_BYTES", "1MB")
    with pytest.raises(KuangchaoError, match="not a whole number of bytes"):
        edge.max_body_bytes()
    monkeypatch.setenv("KC_API_MAX_BODY_BYTES", "4096")
    assert edge.max_body_bytes() == 4096


@pytest.mark.parametrize(("path", "job_id"), [
    ("{id}:events", "{id}:events"), ("{id}:*", "{id}:*"), ("*", "*"), ("a%3Ab", "a:b")])
def test_an_id_that_is_no_job_id_answers_exactly_as_a_missing_job(api, path, job_id):
    store, client, _ = api
    job = client.post("/v1/jobs", json=SPEC).json()
    store.add_event(job["id"], {"type": "note"})  # so `{id}:events` names a real key
    missing = client.get("/v1/jobs/nope-00000000")
    resp = client.get(f"/v1/jobs/{path.format(id=job['id'])}")
    assert resp.status_code == missing.status_code == 404
    assert (resp.json()["detail"].replace(job_id.format(id=job["id"]), "ID")
            == missing.json()["detail"].replace("nope-00000000", "ID"))


def alias_bomb(levels: int = 9) -> str:
    """About 400 bytes of YAML that expand to 10**levels values."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_in_milliseconds_and_nothing_is_stored(api):
    store, client, _ = api
    body = alias_bomb()
    assert len(body) < 500
    t0 = time.perf_counter()
    resp = client.post("/v1/jobs", content=body, headers={"content-type": "application/yaml"})
    elapsed = time.perf_counter() - t0
    assert resp.status_code == 422, resp.text
    assert "expands to more than 100,000 values" in resp.text
    assert elapsed < 10, "the bomb went off"  # generous: the point is not minutes
    assert store.list() == []


def test_a_flood_of_refusals_leaves_a_bounded_trail_that_counts_what_it_skipped(api):
    store, client, stranger = api
    for _ in range(50):
        assert stranger.get("/v1/jobs").status_code == 401
    records = audit_records(store)
    assert len(records) == 5, "the sampler let the flood through"
    # Allowed decisions are never sampled.
    for _ in range(8):
        assert client.post("/v1/jobs", json=SPEC).status_code == 201
    assert sum(r["decision"] == "allow" for r in audit_records(store)) == 8


def test_the_sampler_reports_the_count_it_skipped_when_the_window_turns():
    s = DenialSampler(burst=2, window_s=10)
    assert [s.admit("a", t) for t in (0, 1, 2, 3, 4)] == [
        (True, 0), (True, 0), (False, 0), (False, 0), (False, 0)]
    assert s.admit("b", 5) == (True, 0), "sources are counted apart"
    assert s.admit("a", 11) == (True, 3)
    assert s.admit("a", 12) == (True, 0)


def test_the_sampler_forgets_old_sources_instead_of_growing():
    s = DenialSampler(burst=1, window_s=1, max_sources=100)
    for i in range(1000):
        s.admit(f"client {i}", float(i))
    assert len(s._seen) <= 100


def test_a_listing_filters_by_tenant_before_it_limits(api, monkeypatch):
    from kuangchao.api.server.dependencies import listing

    store, client, _ = api
    monkeypatch.setattr(listing, "LIST_PAGE", 4)
    mine = [client.post("/v1/jobs", json=SPEC).json()["id"] for _ in range(3)]
    other, _ = KeyStore(store).create("bob", "team-b", "submitter")
    for _ in range(10):  # a busy tenant submits after
        assert client.post("/v1/jobs", json=SPEC,
                           headers={"Authorization": f"Bearer {other}"}).status_code == 201
    listed = client.get("/v1/jobs", params={"limit": 2}).json()["jobs"]
    assert [j["id"] for j in listed] == mine[1:]
    assert [j["id"] for j in client.get("/v1/jobs").json()["jobs"]] == mine


def running_job(store, tenant: str = "team-a", steps: int = 5) -> str:
    from kuangchao.platform.jobs.state import JobRecord, JobState

    doc = {**SPEC, "training": {"steps": steps}}
    store.create(JobRecord(id="dbg-00000001", name="dbg", spec=doc, state=JobState.RUNNING,
                           world_size=2, tenant=tenant))
    return "dbg-00000001"


def test_a_debug_step_past_the_jobs_last_is_refused(api):
    store, client, _ = api
    job_id = running_job(store, steps=5)
    resp = client.post(f"/v1/jobs/{job_id}/debug/gradient", json={"step": 10**12})
    assert resp.status_code == 422 and "trains 5 steps" in resp.text
    resp = client.post(f"/v1/jobs/{job_id}/debug/comm", json={"timeout_s": 600})
    assert resp.status_code == 422, "a wait longer than the bound"


def test_debug_waits_hold_no_thread_and_past_their_bound_get_429(api, monkeypatch):
    import threading

    from kuangchao.api.server.routers import debug as debug_router

    store, client, _ = api
    job_id = running_job(store)
    monkeypatch.setattr(debug_router, "WAITS", debug_router.Waits(total=8, per_tenant=1))
    first: dict = {}
    waiting = threading.Thread(target=lambda: first.update(resp=client.post(
        f"/v1/jobs/{job_id}/debug/comm", json={"timeout_s": 5})))
    waiting.start()
    deadline = time.monotonic() + 10
    while not debug_router.WAITS._open and time.monotonic() < deadline:
        time.sleep(0.01)  # until the first request is waiting
    assert debug_router.WAITS._open == {"team-a": 1}
    second = client.post(f"/v1/jobs/{job_id}/debug/memory", json={"timeout_s": 3})
    assert second.status_code == 429 and second.headers["retry-after"] == "5"
    assert "team-a has 1 debug requests waiting" in second.json()["detail"]
    assert client.get("/healthz").status_code == 200
    assert waiting.is_alive(), "healthz should answer while the wait still holds"
    waiting.join(timeout=30)
    assert first["resp"].status_code == 200 and first["resp"].json()["missing"] == [0, 1]
    assert debug_router.WAITS._open == {}
