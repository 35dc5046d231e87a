"""The audit trail against a real Redis: stream and file, filters, a Redis outage."""

from __future__ import annotations

import json

import pytest
import redis

from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.security.audit import AuditLog, AuditRecord

pytestmark = pytest.mark.integration


def test_records_reach_the_stream_and_the_file_and_filter_back(store, tmp_path):
    trail = AuditLog(store, tmp_path / "audit.jsonl")
    trail.record(AuditRecord("alice", "job.submit", "job/a1", "allow", job="a1", ts=100.0))
    trail.record(AuditRecord("job-b/rank-1", "collective.broadcast", "group/dp", "deny",
                             reason="not in the whitelist", job="b1", ts=101.0))
    trail.record(AuditRecord("bob", "job.cancel", "job/a1", "deny", reason="viewer", job="a1",
                             ts=102.0))
    assert [r["action"] for r in trail.read()] == ["job.submit", "collective.broadcast",
                                                   "job.cancel"]
    assert [r["principal"] for r in trail.read(job="a1", decision="deny")] == ["bob"]
    assert len(trail.read(limit=2)) == 2 and trail.read(limit=2)[-1]["principal"] == "bob"
    lines = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [x["decision"] for x in lines] == ["allow", "deny", "deny"]


def test_a_record_still_reaches_the_file_when_redis_is_away(tmp_path):
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    trail = AuditLog(JobStore(dead, "kc:"), tmp_path / "audit.jsonl")
    trail.record(AuditRecord("alice", "key.revoke", "key/k1", "allow"))
    assert json.loads((tmp_path / "audit.jsonl").read_text())["action"] == "key.revoke"
