"""`kc audit`: one line per record, `--since` as a date, time or age, and `--task`
(the `task` query of `GET /v1/audit`, resolved to the caller's visible jobs).
In process, on the in-memory store."""

from __future__ import annotations

import calendar
import json

import pytest
import typer
from fastapi import HTTPException
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from kuangchao.api.cli.render import audit_line, audit_subject
from kuangchao.api.sdk.errors import ApiError
from kuangchao.platform.security.audit import AuditRecord

TS = calendar.timegm((2024, 1, 15, 10, 23, 45))  # 2024-01-15 10:23:45 UTC


def rec(**kw):
    return {"principal": "alice[team-a/0123456789abcdef]", "action": "job.cancel",
            "resource": "job/x", "decision": "allow", "reason": "", "job": None, "ts": TS, **kw}


def test_a_rank_denial_reads_as_one_line_in_utc():
    line = audit_line(rec(principal="tiny-1a2b3c4d/rank-3", action="all_reduce",
                          decision="deny", reason="token expired", job="tiny-1a2b3c4d"))
    assert line == "2024-01-15 10:23:45 | worker-3 | all_reduce | DENIED | token expired"


def test_subjects_other_than_ranks_keep_their_names():
    assert audit_line(rec()) == ("2024-01-15 10:23:45 | alice[team-a/0123456789abcdef] | "
                                 "job.cancel | ALLOWED | -")
    assert audit_subject(rec(principal="j-1/rank-0/data", job="j-1")) == "worker-0/data"
    assert audit_subject(rec(principal="j-1/rank-12", job=None)) == "worker-12"
    for who in ("token-authority", "unverified", "driver:ray-job/raysubmit_1",
                "j-1/rank-2[team/0123456789abcdef]"):  # an API key named like a rank
        assert audit_subject(rec(principal=who, job="j-1")) == who
    # A rank of another job than the record's is not passed off as this job's worker.
    assert audit_subject(rec(principal="other/rank-1", job="j-1")) == "other/rank-1"


def test_record_text_is_terminal_safe_and_stays_on_one_line():
    line = audit_line(rec(reason="bad\x1b[2J\nnext\tline", principal="x\u202ey"))
    assert "\x1b" not in line and "\n" not in line and "\u202e" not in line
    assert line.endswith("| bad\\x1b[2J\\nnext line")
    assert audit_line(rec(ts=None)).startswith("- | ")


def test_since_takes_dates_times_ages_and_unix_seconds():
    from kuangchao.api.cli.admin import parse_since

    assert parse_since("2024-01-01") == calendar.timegm((2024, 1, 1, 0, 0, 0))
    assert parse_since("2024-01-15T10:23:45") == TS
    assert parse_since("2024-01-15 10:23:45") == TS
    assert parse_since("2024-01-15T11:23:45+01:00") == TS
    assert parse_since("2h", now=10_000.0) == 10_000.0 - 7200
    assert parse_since("1700000000") == 1_700_000_000.0
    for bad in ("yesterday", "2024-13-01", "", "nan", "-5", "1969-12-31"):
        with pytest.raises(typer.Exit) as info:
            parse_since(bad)
        assert info.value.exit_code == 2


def test_cli_audit_text_json_and_bad_input(monkeypatch):
    from kuangchao.api.cli import admin, main

    calls = []
    records = [rec(principal="j-1/rank-3", action="all_reduce", decision="deny",
                   reason="token expired", job="j-1")]

    class FakeClient:
        def audit(self, job, since, action, limit, task):
            calls.append((job, since, action, limit, task))
            if task == "nobody":
                raise ApiError(404, "no job named 'nobody' that your key may see")
            return records

    monkeypatch.setattr(admin, "client", lambda: FakeClient())
    runner = CliRunner()
    out = runner.invoke(main.app, ["audit", "--task", "tiny", "--since", "2024-01-01",
                                   "--action", "deny"])
    assert out.exit_code == 0, out.output
    assert out.output == "2024-01-15 10:23:45 | worker-3 | all_reduce | DENIED | token expired\n"
    assert calls[-1] == (None, calendar.timegm((2024, 1, 1, 0, 0, 0)), "deny", 1000, "tiny")
    as_json = runner.invoke(main.app, ["audit", "--json"])
    assert json.loads(as_json.output) == records
    bad = runner.invoke(main.app, ["audit", "--since", "last tuesday"])
    assert bad.exit_code == 2 and "error: --since 'last tuesday' is not a time" in bad.output
    assert "Traceback" not in bad.output
    hidden = runner.invoke(main.app, ["audit", "--task", "nobody"])
    assert hidden.exit_code == 2 and "error: " in hidden.output and "nobody" in hidden.output


# -- the route ----------------------------------------------------------------------

SPEC = {"model": {"n_layers": 1, "n_heads": 2, "d_model": 32, "seq_len": 32},
        "parallel": {"data_parallel_size": 1}, "training": {"steps": 5}}


@pytest.fixture
def api(monkeypatch, tmp_path):
    from kuangchao.api.server.app import create_app
    from kuangchao.api.server.dependencies import auth
    from kuangchao.platform.control import operations as jobs
    from kuangchao.platform.security.keystore import KeyStore
    from kuangchao.platform.spec.jobspec import validate_spec
    from tests.unit.api_fakes import memory_api

    store = memory_api(monkeypatch, tmp_path)

    def submit(name, tenant):
        return jobs.submit(store, validate_spec({"task": {"name": name}, **SPEC}),
                           owner="someone", tenant=tenant).id

    ids = {"a1": submit("tiny", "team-a"), "a2": submit("tiny", "team-b"),
           "other": submit("other", "team-a"), "b": submit("secret", "team-b")}
    trail = auth._trail(store)
    for key, job_id in ids.items():
        trail.record(AuditRecord(f"{job_id}/rank-0", "all_reduce", "group/dp", "deny",
                                 reason=f"about {key}", job=job_id))
    key, _ = KeyStore(store).create("ops", "ops", "operator")
    client = TestClient(create_app())
    client.headers["Authorization"] = f"Bearer {key}"
    yield store, client, ids
    auth._trail.cache_clear()


def test_task_covers_every_visible_job_of_that_name(api):
    _, client, ids = api
    resp = client.get("/v1/audit", params={"task": "tiny", "action": "deny"})
    assert resp.status_code == 200, resp.text
    assert {r["reason"] for r in resp.json()["records"]} == {"about a1", "about a2"}
    both = client.get("/v1/audit", params={"task": "tiny", "job": ids["a1"]}).json()["records"]
    assert [r["reason"] for r in both] == ["about a1"]


def test_a_task_nobody_may_see_is_404(api):
    _, client, _ = api
    resp = client.get("/v1/audit", params={"task": "no-such-task"})
    assert resp.status_code == 404
    assert "no job named 'no-such-task'" in resp.json()["detail"]


def test_task_resolution_keeps_to_the_callers_tenant(api):
    from kuangchao.api.server.routers.audit import task_jobs
    from kuangchao.platform.security.apikeys import Principal

    store, _, ids = api
    viewer = Principal("0123456789abcdef", "v", "team-a", "viewer")
    assert task_jobs(store, viewer, "tiny") == {ids["a1"]}
    with pytest.raises(HTTPException) as info:
        task_jobs(store, viewer, "secret")  # exists, but in another tenant: as if missing
    assert info.value.status_code == 404
    denied = [json.loads(x) for x in store.audit_lines(None)]
    assert any(r["action"] == "audit.read" and r["decision"] == "deny"
               and r["resource"] == "task/secret" for r in denied)


def test_the_trail_reads_a_set_of_jobs(api):
    from kuangchao.api.server.dependencies import auth

    store, _, ids = api
    trail = auth._trail(store)
    got = trail.read(jobs={ids["a1"], ids["b"]})
    assert {r["reason"] for r in got} == {"about a1", "about b"}
    assert trail.read(jobs=set()) == []
