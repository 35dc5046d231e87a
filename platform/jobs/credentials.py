"""What security keeps in Redis: API key records, capability-token revocation
marks and the tokens issued per job, the jobs holding credentials, each job's
Redis ACL user with its password, and the audit stream. platform/security
decides; this is where it stores."""

from __future__ import annotations

from collections.abc import Iterator

import redis

from kuangchao.platform.jobs import keys, redis_acl
from kuangchao.platform.jobs.encoding import AUDIT_CAP


class Credentials:
    """The credentials part of `JobStore`."""

    r: redis.Redis
    p: str

    # -- API keys: key id -> JSON record (platform/security/keystore.py) --------------
    def api_key(self, key_id: str) -> str | None:
        return self.r.hget(keys.api_keys(self.p), key_id)

    def put_api_key(self, key_id: str, record: str) -> None:
        self.r.hset(keys.api_keys(self.p), key_id, record)

    def api_key_records(self) -> list[str]:
        return self.r.hvals(keys.api_keys(self.p))

    # -- capability tokens -------------------------------------------------------------
    def revoke_token(self, token_id: str, reason: str, ttl_s: int) -> None:
        """Mark the token revoked for `ttl_s` (until it would have expired anyway)."""
        self.r.set(keys.revoked(self.p, token_id), reason, ex=ttl_s)

    def token_revoked(self, token_id: str) -> bool:
        """Whether the token is marked revoked (a job's own Redis user may ask)."""
        return bool(self.r.exists(keys.revoked(self.p, token_id)))

    def record_token(self, job_id: str, token_id: str, expires_at: float) -> None:
        self.r.hset(keys.issued(self.p, job_id), token_id, str(expires_at))

    def issued_tokens(self, job_id: str) -> dict[str, float]:
        """The job's issued token ids and their expiry times."""
        return {t: float(e) for t, e in self.r.hgetall(keys.issued(self.p, job_id)).items()}

    def forget_tokens(self, job_id: str) -> None:
        self.r.delete(keys.issued(self.p, job_id))

    def mark_job_revoked(self, job_id: str, reason: str, ttl_s: int) -> None:
        """Note that every token of the job is revoked (set before they are, one by one)."""
        self.r.set(keys.job_revoked(self.p, job_id), reason, ex=ttl_s)

    def job_revoked(self, job_id: str) -> bool:
        return bool(self.r.exists(keys.job_revoked(self.p, job_id)))

    # -- the control plane's credential for the token authority ---------------------
    def control_secret(self) -> str | None:
        """What the scheduler and controllers present to the authority (admin only)."""
        return self.r.get(keys.control_secret(self.p))

    def offer_control_secret(self, secret: str) -> str:
        """Keep `secret` unless one is kept already; returns the one kept."""
        self.r.set(keys.control_secret(self.p), secret, nx=True)
        return self.r.get(keys.control_secret(self.p)) or secret

    def hold_credentials(self, job_id: str) -> None:
        """Note that the job holds credentials (the authority's sweep visits it)."""
        self.r.sadd(keys.auth_jobs(self.p), job_id)

    def release_credentials(self, job_id: str) -> None:
        self.r.srem(keys.auth_jobs(self.p), job_id)

    def credential_jobs(self) -> set[str]:
        return set(self.r.smembers(keys.auth_jobs(self.p)))

    # -- the job's Redis ACL user ---------------------------------------------------
    def job_user_password(self, job_id: str) -> str | None:
        return self.r.get(keys.job_user_secret(self.p, job_id))

    def grant_job_user(self, job_id: str, password: str | None = None) -> str:
        """Create (or reset) the job's ACL user, with `password` or a new random one,
        and keep the password; returns it."""
        _, password = redis_acl.grant_job_user(self.r, self.p, job_id, password)
        self.r.set(keys.job_user_secret(self.p, job_id), password)
        return password

    def has_job_user(self, job_id: str) -> bool:
        """Whether Redis has the job's user (a restarted Redis has lost them all)."""
        return redis_acl.has_job_user(self.r, job_id)

    def revoke_job_user(self, job_id: str) -> None:
        """Delete the job's ACL user; its kept password goes with `forget_job_user`."""
        redis_acl.revoke_job_user(self.r, job_id)

    def forget_job_user(self, job_id: str) -> None:
        self.r.delete(keys.job_user_secret(self.p, job_id))

    # -- the audit stream -------------------------------------------------------------
    def append_audit(self, line: str) -> None:
        """Add one audit record (JSON text); the stream keeps about the newest AUDIT_CAP."""
        self.r.xadd(keys.audit(self.p), {"r": line}, maxlen=AUDIT_CAP, approximate=True)

    def audit_lines(self, since: float | None = None) -> Iterator[str]:
        """The audit records written at `since` or later, newest first."""
        start = f"{int(since * 1000)}-0" if since is not None else "-"
        for _, fields in self.r.xrevrange(keys.audit(self.p), max="+", min=start):
            yield fields["r"]
