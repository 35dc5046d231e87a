"""The store contract, continued (tests/store_contract.py has the core): API key
records, token marks, the jobs' users, the audit stream, debug requests,
heartbeats and fence sets. No Redis import here either."""

from __future__ import annotations

import time

import pytest

from kuangchao.platform.observability import metrics
from kuangchao.platform.protocol.heartbeat import Beat
from kuangchao.platform.security.audit import AuditLog, AuditRecord
from kuangchao.platform.security.keystore import KeyStore


def test_api_key_records_are_kept_by_key_id(store):
    assert store.api_key("k1") is None and store.api_key_records() == []
    store.put_api_key("k1", '{"a": 1}')
    store.put_api_key("k2", '{"b": 2}')
    store.put_api_key("k1", '{"a": 3}')
    assert store.api_key("k1") == '{"a": 3}'
    assert sorted(store.api_key_records()) == ['{"a": 3}', '{"b": 2}']


def test_the_keystore_runs_on_the_store(store):
    keys = KeyStore(store)
    secret, principal = keys.create("alice", "t1", "submitter")
    assert [p.name for p in keys.list()] == ["alice"]
    keys.revoke(principal.key_id)
    assert keys.list() == [] and keys.list(include_revoked=True)[0].revoked_at is not None
    assert keys.get(principal.key_id).principal.name == "alice" and secret


def test_a_token_mark_lasts_its_ttl(store):
    assert not store.token_revoked("t1")
    store.revoke_token("t1", "renewed", ttl_s=1)
    assert store.token_revoked("t1") and not store.token_revoked("t2")
    time.sleep(1.3)
    assert not store.token_revoked("t1")


def test_issued_tokens_and_the_jobs_holding_credentials(store):
    assert store.issued_tokens("j1") == {} and store.credential_jobs() == set()
    store.record_token("j1", "t1", 100.5)
    store.record_token("j1", "t2", 200.0)
    store.record_token("j2", "t3", 300.0)
    assert store.issued_tokens("j1") == {"t1": 100.5, "t2": 200.0}
    store.forget_tokens("j1")
    assert store.issued_tokens("j1") == {} and store.issued_tokens("j2") == {"t3": 300.0}
    store.hold_credentials("j1")
    store.hold_credentials("j2")
    store.hold_credentials("j1")
    assert store.credential_jobs() == {"j1", "j2"}
    store.release_credentials("j1")
    store.release_credentials("j9")
    assert store.credential_jobs() == {"j2"}


def test_the_audit_stream_reads_back_newest_first_and_from_a_time(store, tmp_path):
    assert list(store.audit_lines()) == []
    store.append_audit('{"n": 1}')
    time.sleep(0.05)
    mid = time.time()
    time.sleep(0.05)
    store.append_audit('{"n": 2}')
    assert list(store.audit_lines()) == ['{"n": 2}', '{"n": 1}']
    assert list(store.audit_lines(since=mid)) == ['{"n": 2}']
    trail = AuditLog(store, tmp_path / "audit.jsonl")
    trail.record(AuditRecord("alice", "job.submit", "job/a1", "allow", job="a1"))
    assert [r["principal"] for r in trail.read(job="a1")] == ["alice"]


def test_debug_requests_replace_each_other_and_collect_answers_by_rank(store):
    assert store.debug_request("j1") is None
    with pytest.raises(ValueError):
        store.post_debug("j1", "nonsense")
    first = store.post_debug("j1", "comm")
    req = store.post_debug("j1", "gradient", step=7)
    got = store.debug_request("j1")
    assert got == req and got.kind == "gradient" and got.step == 7 and got.id != first.id
    store.retire_debug("j1", first.id)  # an older request: the newer one stays
    assert store.debug_request("j1") == req
    assert store.debug_answers("j1", req.id) == {}
    store.answer_debug("j1", req.id, 1, {"rank": 1, "params": {}})
    store.answer_debug("j1", req.id, 0, {"rank": 0, "at": time})  # unjsonable: as text
    answers = store.debug_answers("j1", req.id)
    assert sorted(answers) == [0, 1] and answers[1] == {"rank": 1, "params": {}}
    assert isinstance(answers[0]["at"], str)
    store.retire_debug("j1", req.id)
    assert store.debug_request("j1") is None and len(store.debug_answers("j1", req.id)) == 2
    prof = store.post_debug("j1", "profile", steps=3)
    assert store.debug_request("j1").steps == 3 and prof.kind == "profile"


def test_beats_expire_and_drop(store):
    beat = Beat(2, 10, "train", 123, "node-a", time.time(), time.time(), 1)
    store.put_beat("j1", 2, beat.encode(), ttl_s=0.5)
    store.put_beat("j1", 3, beat.encode(), ttl_s=30)
    got = store.beats("j1", [1, 2, 3], cache={})
    assert got[1] is None and got[2].step == 10 and got[2].node == "node-a"
    store.drop_beat("j1", 3)
    time.sleep(0.7)
    assert store.beats("j1", [2, 3]) == {2: None, 3: None}


def test_the_fence_set_collects_each_jobs_replaced_processes(store):
    assert store.fenced("j1") == set()
    store.fence("j1", ["101@n1", "102@n1"])
    store.fence("j1", ["102@n1", "7@n2"])
    store.fence("j1", [])
    assert store.fenced("j1") == {"101@n1", "102@n1", "7@n2"} and store.fenced("j2") == set()


def test_ping(store):
    assert store.ping()


def test_the_gauges_read_every_job_at_once(store):
    store.recorder("j1").inc(metrics.RESTARTS, job="j1", cause="died")
    store.recorder().inc(metrics.JOBS_FINISHED, state="SUCCEEDED", queue="default")
    store.set_progress("j1", {"step": 4, "loss": 1.25})
    store.add_checkpoint("j1", {"step": 2, "path": "/c/2"})
    store.add_checkpoint("j1", {"step": 4, "path": "/c/4"})
    beat = Beat(0, 4, "train", 99, "node-a", time.time(), time.time(), 1)
    store.put_beat("j1", 0, beat.encode(), ttl_s=30)
    store.set_info("queues", {"queues": [{"name": "default"}]})
    reads = store.read_for_gauges([("j1", 2), ("j2", 1)])
    assert reads["queues"] == {"queues": [{"name": "default"}]} and reads["nodes"] is None
    assert sum(reads["cluster"].values()) == 1.0 and sum(reads["jobs"]["j1"].values()) == 1.0
    assert reads["jobs"]["j2"] == {} and reads["progress"]["j2"] == {}
    assert reads["progress"]["j1"]["step"] == 4 and reads["progress"]["j1"]["loss"] == 1.25
    assert reads["checkpoint"]["j1"]["step"] == 4 and reads["checkpoint"]["j2"] is None
    assert [b.step if b else None for b in reads["beats"]["j1"]] == [4, None]
    assert reads["beats"]["j2"] == [None]
