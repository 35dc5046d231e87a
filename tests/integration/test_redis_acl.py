"""Per-job Redis ACL users on a password-protected redis-server of the test's own:
one job's worker credentials reach its own keys and no other job's."""

from __future__ import annotations

import dataclasses

import pytest
import redis

from kuangchao.platform.jobs.redis_acl import grant_job_user, revoke_job_user, url_for
from kuangchao.platform.jobs.state import JobRecord
from kuangchao.platform.jobs.store import JobStore

from .private_redis import PrivateRedis

pytestmark = pytest.mark.integration
PREFIX = "kc:"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = PrivateRedis(tmp_path_factory.mktemp("acl"), password="admin-secret-for-this-test")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def test_a_job_user_reaches_its_own_keys_and_no_one_elses(server):
    admin = redis.Redis.from_url(server.url, decode_responses=True)
    admin.set(f"{PREFIX}job:b-2222:progress", "theirs")
    admin.set(f"{PREFIX}job:a-1111-x-3333", "a job whose id starts with a-1111")
    user, password = grant_job_user(admin, PREFIX, "a-1111")
    mine = redis.Redis.from_url(url_for(server.url, user, password), decode_responses=True)

    for jid in ("a-1111", "b-2222"):
        JobStore(admin, PREFIX).create(JobRecord(id=jid, name=jid, spec={}))
    store = JobStore(mine, PREFIX)
    # What a worker does: progress, logs, and reading its record. The record itself
    # (tenant, priority, queue, spec, state) is the control plane's to write.
    store.set_progress("a-1111", {"step": 3})
    store.add_logs("a-1111", [{"message": "a line"}])
    assert store.get("a-1111").id == "a-1111" and store.progress("a-1111")["step"]
    for jid in ("a-1111", "b-2222"):
        with pytest.raises(redis.exceptions.NoPermissionError):
            store.update(jid, lambda j: (dataclasses.replace(j, priority=10**15), None))
    for attempt in (lambda: mine.set(f"{PREFIX}job:a-1111", "{}"),
                    lambda: mine.delete(f"{PREFIX}job:a-1111"),
                    lambda: mine.eval("while true do end", 0)):  # would block every client
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    assert JobStore(admin, PREFIX).get("a-1111").priority == 50

    denied = [
        lambda: mine.get(f"{PREFIX}job:b-2222:progress"),
        lambda: mine.set(f"{PREFIX}job:b-2222:progress", "overwritten"),
        lambda: mine.get(f"{PREFIX}job:a-1111-x-3333"),
        lambda: mine.get(f"{PREFIX}quarantine"),
        lambda: mine.eval("return redis.call('GET', KEYS[1])", 1, f"{PREFIX}job:b-2222:progress"),
        lambda: mine.scan(),
        lambda: mine.keys("*"),
        lambda: mine.flushall(),
        lambda: mine.execute_command("ACL", "LIST"),
        lambda: mine.config_get("requirepass"),
    ]
    for attempt in denied:
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    assert admin.get(f"{PREFIX}job:b-2222:progress") == "theirs"
    assert JobStore(admin, PREFIX).get("b-2222").message is None
    # Revocation marks: readable, so a worker learns its token was revoked; never writable.
    admin.set(f"{PREFIX}auth:revoked:t-1", "revoked by an admin")
    assert mine.exists(f"{PREFIX}auth:revoked:t-1") == 1
    for attempt in (lambda: mine.delete(f"{PREFIX}auth:revoked:t-1"),
                    lambda: mine.set(f"{PREFIX}auth:revoked:t-2", "x"),
                    lambda: mine.hgetall(f"{PREFIX}auth:keys")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    # The job's fence set: its ranks read whether they were replaced, and none can
    # take itself out (or put itself in, or reach another job's).
    JobStore(admin, PREFIX).fence("a-1111", ["4242@n1"])
    assert store.fenced("a-1111") == {"4242@n1"}
    assert mine.sismember(f"{PREFIX}fenced:a-1111", "4242@n1")
    for attempt in (lambda: mine.srem(f"{PREFIX}fenced:a-1111", "4242@n1"),
                    lambda: mine.delete(f"{PREFIX}fenced:a-1111"),
                    lambda: mine.sadd(f"{PREFIX}fenced:a-1111", "1@n2"),
                    lambda: mine.expire(f"{PREFIX}fenced:a-1111", 1),
                    lambda: mine.smembers(f"{PREFIX}fenced:b-2222")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()

    revoke_job_user(admin, "a-1111")
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(url_for(server.url, user, password)).ping()


def test_a_wrong_password_is_refused(server):
    admin = redis.Redis.from_url(server.url, decode_responses=True)
    user, _ = grant_job_user(admin, PREFIX, "c-4444")
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(url_for(server.url, user, "guess")).ping()
    revoke_job_user(admin, "c-4444")


def test_the_authority_restores_a_running_jobs_user_that_redis_lost(server, tmp_path):
    """A restarted Redis keeps its data but not its ACL users: the authority puts the
    job's user back with the same password, so the ranks' URLs work again."""
    from kuangchao.platform.jobs.state import JobState
    from kuangchao.platform.security.audit import AuditLog
    from kuangchao.platform.security.authority import TokenAuthority
    from kuangchao.platform.security.tokens import generate_key

    admin = redis.Redis.from_url(server.url, decode_responses=True)
    store = JobStore(admin, "kc-restore:")
    store.create(JobRecord(id="r-5555", name="r", spec={}))
    auth = TokenAuthority(store, generate_key(), AuditLog(store, None),
                          server.url, job_acl=True)
    url = auth.grant_workers("r-5555", {0: ()})[0].redis_url
    assert redis.Redis.from_url(url).ping()
    admin.execute_command("ACL", "DELUSER", "kc-job-r-5555")  # what a restart does
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(url).ping()
    assert auth.restore_users() == ["r-5555"]
    assert redis.Redis.from_url(url).ping()  # the same URL, hence the same password
    assert auth.restore_users() == []  # nothing missing now
    store.update("r-5555", lambda j: (dataclasses.replace(j, state=JobState.SUCCEEDED), None))
    assert auth.sweep() == ["r-5555"]  # ended: tokens revoked, user gone for good
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(url).ping()
    assert auth.restore_users() == []
