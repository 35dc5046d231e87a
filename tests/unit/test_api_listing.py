"""What every console tab polls, and the submit path's caches: job listings walk
by cursor (every job once, bad cursors and limits refused with a clear 422),
polled answers are cached per tenant scope and never cross tenants, a revoked
key is refused at once. In process, on the in-memory store; the Redis side of
the cursor (`JobStore.jobs_before`) and the served store's cache run against
the local Redis when one answers (127.0.0.1:6379, a key prefix of their own).
"""

from __future__ import annotations

import secrets

import pytest
from fastapi.testclient import TestClient

from kuangchao.api.sdk.client import Client
from kuangchao.api.server.app import create_app
from kuangchao.api.server.dependencies import auth, listing
from kuangchao.api.server.schemas.jobs import JobPublic
from kuangchao.platform.jobs.memory import MemoryStore
from kuangchao.platform.jobs.state import JobRecord
from kuangchao.platform.security.keystore import KeyStore
from tests.unit.api_fakes import memory_api

SPEC = {"task": {"name": "lst"}, "model": {"n_layers": 1, "n_heads": 2, "d_model": 32,
                                            "seq_len": 32},
        "parallel": {"data_parallel_size": 1}, "training": {"steps": 5}}


@pytest.fixture
def api(monkeypatch, tmp_path):
    store = memory_api(monkeypatch, tmp_path)
    app = create_app()

    def client(tenant: str, role: str = "submitter") -> TestClient:
        key, _ = KeyStore(store).create(f"u-{secrets.token_hex(3)}", tenant, role)
        c = TestClient(app)
        c.headers["Authorization"] = f"Bearer {key}"
        return c

    yield store, client
    auth._trail.cache_clear()


def walk(c: TestClient, limit: int) -> tuple[list[str], int]:
    """Every job id a cursor walk gives, newest page first, and the pages it took."""
    ids: list[str] = []
    cursor, pages = None, 0
    while True:
        params = {"limit": limit, **({"cursor": cursor} if cursor else {})}
        resp = c.get("/v1/jobs", params=params)
        assert resp.status_code == 200, resp.text
        doc = resp.json()
        pages += 1
        page = [j["id"] for j in doc["jobs"]]
        assert len(page) <= limit
        ids = page + ids  # each page is older than the one before, oldest first within
        cursor = doc["next_cursor"]
        if cursor is None:
            return ids, pages


def test_a_cursor_walk_gives_every_job_once_oldest_first(api, monkeypatch):
    store, client = api
    monkeypatch.setattr(listing, "LIST_PAGE", 3)  # the tenant filter reads several batches
    a, b, op = client("team-a"), client("team-b"), client("ops", "operator")
    mine = []
    for i in range(11):
        mine.append(a.post("/v1/jobs", json=SPEC).json()["id"])
        if i % 2:
            assert b.post("/v1/jobs", json=SPEC).status_code == 201
    ids, pages = walk(a, 4)
    assert ids == mine and pages >= 3
    everyone, _ = walk(op, 5)
    assert len(everyone) == len(set(everyone)) == 16 and set(mine) <= set(everyone)
    assert walk(b, 100)[0] == [i for i in everyone if i not in mine]


def test_jobs_submitted_during_a_walk_do_not_shift_its_pages(api):
    _, client = api
    a = client("team-a")
    first = [a.post("/v1/jobs", json=SPEC).json()["id"] for _ in range(6)]
    doc = a.get("/v1/jobs", params={"limit": 2}).json()
    assert [j["id"] for j in doc["jobs"]] == first[-2:]
    for _ in range(5):
        a.post("/v1/jobs", json=SPEC)
    seen = [j["id"] for j in doc["jobs"]]
    cursor = doc["next_cursor"]
    while cursor:
        doc = a.get("/v1/jobs", params={"limit": 2, "cursor": cursor}).json()
        seen = [j["id"] for j in doc["jobs"]] + seen
        cursor = doc["next_cursor"]
    assert seen == first


def test_jobs_with_the_same_creation_time_are_each_listed_once(api):
    store, client = api
    a = client("team-a")
    for i in range(7):  # one timestamp: only the id orders them
        store.create(JobRecord(id=f"tie-{i:08d}", name="tie", spec=SPEC, created_at=1000.0,
                               tenant="team-a"))
    ids, _ = walk(a, 2)
    assert ids == [f"tie-{i:08d}" for i in range(7)]


@pytest.mark.parametrize("params", [{"cursor": "nope"}, {"cursor": "W10"},
                                    {"cursor": "WzEuMCwgIi4uLy4uIl0"}, {"cursor": "x" * 300}])
def test_a_cursor_this_api_did_not_give_is_a_clear_422(api, params):
    _, client = api
    resp = client("team-a").get("/v1/jobs", params=params)
    assert resp.status_code == 422, resp.text
    (problem,) = resp.json()["detail"]
    assert problem["field"] == "query.cursor"
    assert "Traceback" not in resp.text


@pytest.mark.parametrize("limit", ["0", "10001", "-1", "ten"])
def test_a_bad_limit_is_a_clear_422(api, limit):
    _, client = api
    resp = client("team-a").get("/v1/jobs", params={"limit": limit})
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"][0]["field"] == "query.limit"


def test_the_polled_cache_never_answers_one_tenant_with_anothers_jobs(api):
    _, client = api
    a, a2, b = client("team-a"), client("team-a", "viewer"), client("team-b")
    a_job = a.post("/v1/jobs", json=SPEC).json()["id"]
    assert [j["id"] for j in a.get("/v1/jobs").json()["jobs"]] == [a_job]  # now cached
    assert b.get("/v1/jobs").json()["jobs"] == []
    assert [j["id"] for j in a2.get("/v1/jobs").json()["jobs"]] == [a_job]  # same scope
    b_job = b.post("/v1/jobs", json=SPEC).json()["id"]
    # Its author sees the new job at once: a change here drops the cached answers.
    assert [j["id"] for j in b.get("/v1/jobs").json()["jobs"]] == [b_job]
    assert [j["id"] for j in a.get("/v1/jobs").json()["jobs"]] == [a_job]
    assert len(client("ops", "operator").get("/v1/jobs").json()["jobs"]) == 2


def test_the_node_view_is_cached_per_scope(api):
    store, client = api
    store.set_info("nodes", {"nodes": [], "updated_at": 1.0})
    a, b = client("team-a"), client("team-b")
    assert a.get("/v1/nodes").json() == b.get("/v1/nodes").json() == {"nodes": [],
                                                                          "updated_at": 1.0}
    assert {k[:2] for k in listing._polled._items} >= {("nodes", "tenant:team-a"),
                                                       ("nodes", "tenant:team-b")}


def test_the_submit_answer_is_the_job_model(api):
    _, client = api
    resp = client("team-a").post("/v1/jobs", json=SPEC)
    assert resp.status_code == 201 and resp.headers["content-type"] == "application/json"
    view = resp.json()
    assert JobPublic.model_validate(view).model_dump(exclude_unset=True) == view
    assert view["queue_position"] == 1 and view["tenant"] == "team-a"


def test_a_key_revoked_through_the_api_is_refused_at_once(api):
    store, client = api
    admin, user = client("default", "admin"), client("team-a", "viewer")
    assert user.get("/v1/jobs").status_code == 200  # its record is now cached
    key_id = user.headers["Authorization"].split("_")[1]  # kc_<id>_<secret>
    assert admin.delete(f"/v1/admin/keys/{key_id}").status_code == 200
    resp = user.get("/v1/jobs")
    assert resp.status_code == 401 and "revoked" in resp.json()["detail"]


def test_the_sdk_follows_cursors(api):
    _, client = api
    a = client("team-a")
    ids = [a.post("/v1/jobs", json=SPEC).json()["id"] for _ in range(5)]
    sdk = Client("http://testserver")
    sdk._http = a
    import kuangchao.api.sdk.client as sdk_module

    old = sdk_module.LIST_PAGE_MAX
    sdk_module.LIST_PAGE_MAX = 2
    try:
        assert [j.id for j in sdk.list()] == ids
        assert [j.id for j in sdk.list(limit=3)] == ids[-3:]
    finally:
        sdk_module.LIST_PAGE_MAX = old


# -- against Redis ------------------------------------------------------------------

@pytest.fixture
def redis_store():
    redis = pytest.importorskip("redis")
    from kuangchao.api.server.dependencies.served import ServedStore

    client = redis.Redis.from_url("redis://127.0.0.1:6379/0", decode_responses=True,
                                  socket_connect_timeout=1)
    try:
        client.ping()
    except redis.RedisError:
        pytest.skip("no Redis on 127.0.0.1:6379")
    prefix = f"kctest-listing-{secrets.token_hex(4)}:"
    yield ServedStore(client, prefix)
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)


def test_redis_pages_match_the_memory_store_ties_included(redis_store):
    mem = MemoryStore()
    for i in range(9):
        for s in (redis_store, mem):
            s.create(JobRecord(id=f"r-{i % 3}{i:07d}", name="r", spec=SPEC,
                               created_at=100.0 + i // 3))
    for store in (redis_store, mem):
        pos, seen = None, []
        while True:
            batch = store.jobs_before(pos, 2)
            seen += [i for _, i, job in batch if job is not None]
            if len(batch) < 2:
                break
            pos = batch[-1][:2]
        assert len(seen) == len(set(seen)) == 9
    assert [e[:2] for e in redis_store.jobs_before(None, 9)] == [e[:2] for e in
                                                                 mem.jobs_before(None, 9)]


def test_a_submit_writes_the_job_and_its_audit_record_in_one_step(redis_store):
    line = '{"action": "job.submit"}'
    job = redis_store.create(JobRecord(id="one-00000001", name="one", spec=SPEC),
                             audit_line=line)
    assert redis_store.get(job.id).version == 1
    assert list(redis_store.audit_lines()) == [line]
    assert [i for _, i, _ in redis_store.jobs_before(None, 5)] == [job.id]


def test_the_served_store_caches_tables_and_drops_what_it_writes(redis_store):
    redis_store.set_info("queues", {"queues": [1]})
    assert redis_store.info("queues") == {"queues": [1]}
    redis_store.r.set(f"{redis_store.p}info:queues", '{"queues": [2]}')  # another process
    assert redis_store.info("queues") == {"queues": [1]}  # within INFO_TTL_S
    redis_store.set_info("queues", {"queues": [3]})  # through this process: seen at once
    assert redis_store.info("queues") == {"queues": [3]}
