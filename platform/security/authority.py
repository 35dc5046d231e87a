"""The token authority: mints, renews and revokes capability tokens, and hands
each job a Redis user of its own.

It alone holds the signing key. Workers get the public key, a token per rank
(and one each for its data reader and its metrics endpoint), and the Redis URL
of their job's ACL user; they renew through the authority
before the token expires, and the authority refuses a token that is expired,
revoked, or not its own. Every mint, renewal, refusal and revocation is
audited.

No Ray here: `authority_actor.TokenAuthorityActor` hosts it, and tests step it directly.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kuangchao.platform.errors import ClusterError, JobNotFound, TokenError
from kuangchao.platform.jobs import keys, redis_acl
from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.observability import metrics
from kuangchao.platform.security.audit import AuditLog, AuditRecord
from kuangchao.platform.security.storage_grants import StorageGrants
from kuangchao.platform.security.tokens import (
    DATASET_READ,
    ROLE_INTERFACES,
    Claims,
    Minter,
    Scope,
    Verifier,
    generate_key,
    load_private,
    public_pem,
)
from kuangchao.platform.spec.jobspec import JobSpec
from kuangchao.platform.storage.urls import is_url
from kuangchao.platform.storage.urls import parse as parse_url

log = logging.getLogger(__name__)

AUTHORITY_NAME = "kc-token-authority"  # the control plane's actor (actors.py)
# The longest a token may live (permission.token_ttl_seconds is bounded by it).
MAX_TOKEN_TTL_S = 7 * 86400

# What a trainer may do besides the collectives its spec whitelists.
TRAINER_BASE = frozenset({"checkpoint_read", "checkpoint_write", "heartbeat"})
# The job's own groups: the world, the mesh dimensions, and sub-groups of its ranks.
TRAINER_GROUPS = ("world", "dp", "tp", "pp", "ranks:*")
# The modules a rank runs besides its trainer, each under a token of its own role
# (module name, interfaces), minted with the trainer's in the same grant and scoped
# to nothing: its data reader reads the dataset, its metrics endpoint (and the
# read-only views behind it) the metrics.
RANK_MODULES: dict[str, tuple[str, frozenset[str]]] = {
    "data_loader": ("data", frozenset({DATASET_READ})),
    "monitor": ("metrics", frozenset({"metrics_read"})),
}
# Seeds no deployment may sign with: all one byte (a placeholder someone forgot),
# and RFC 8032's first test vector, the key every Ed25519 example shows.
_KNOWN_SEEDS = {bytes([b]) * 32 for b in range(256)} | {bytes.fromhex(
    "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")}


def load_signing_key(path: str | None, dev: bool,
                     pem: str | None = None) -> tuple[Ed25519PrivateKey, str]:
    """The authority's key and where it came from: `pem` when given (read from
    `path` by whoever started the control plane), else the file at `path`.

    Raises:
        ClusterError: No key outside dev mode, an unreadable key, or a known
            default; the message says how to make one.
    """
    make = ("make one with `openssl genpkey -algorithm ed25519 -out signing-key.pem` "
            "(mode 0600) and set KC_SIGNING_KEY_FILE to it")
    if not path:
        if dev:
            return generate_key(), "ephemeral (local dev mode)"
        raise ClusterError(f"no signing key for the token authority; {make}. Only the local dev "
                           "mode that `kc up` sets may run without one")
    try:
        key = load_private(pem.encode() if pem else Path(path).expanduser().read_bytes())
    except (OSError, ValueError, TypeError) as exc:
        raise ClusterError(f"cannot use the signing key {path}: {exc}; {make}") from None
    from cryptography.hazmat.primitives import serialization

    seed = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())
    if seed in _KNOWN_SEEDS:
        raise ClusterError(f"the signing key {path} is a well-known default, so anyone could mint "
                           f"tokens; {make}")
    return key, path


def checkpoint_dir(root: str, job_id: str) -> str:
    """The job's checkpoint folder as an absolute, normalised path, or its prefix in an
    object store (`s3://bucket/prefix/{job_id}`)."""
    if is_url(root):
        return str(parse_url(root).join(job_id))
    return os.path.normpath(os.path.join(os.path.abspath(os.path.expanduser(root)), job_id))


@dataclass(frozen=True)
class WorkerGrant:
    """What one rank gets: its token, the key to verify it, its Redis URL, and the
    tokens of its other modules by role (`RANK_MODULES`)."""

    token: str
    public_key: bytes
    redis_url: str | None
    modules: dict[str, str] = field(default_factory=dict)
    # The job's object-store credentials (StoreCredentials JSON), scoped to its prefix.
    storage: str | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"token": self.token, "public_key": self.public_key.decode(),
                "redis_url": self.redis_url, "modules": dict(self.modules),
                "storage": self.storage}


class TokenAuthority:
    """Mints and checks tokens for every module of every job.

    Args:
        store: The job store (admin Redis: revocations, issued tokens, ACL users).
        key: The signing key.
        trail: Where decisions are audited.
        admin_url: The admin Redis URL, for building job users' URLs.
        job_acl: Give each job a Redis ACL user (False: workers use `admin_url`).
    """

    def __init__(self, store: JobStore, key: Ed25519PrivateKey, trail: AuditLog,
                 admin_url: str | None, job_acl: bool = True,
                 clock: Callable[[], float] = time.time) -> None:
        self.store, self.trail, self.clock = store, trail, clock
        self.admin_url, self.job_acl = admin_url, job_acl
        self._minter = Minter(key)
        self._public = public_pem(key)
        # Jobs' object-store credentials.
        self.storage = StorageGrants(self._audit, lambda job_id: self.store.get(job_id).spec)
        self._verifier = Verifier(key.public_key(), self.is_revoked, clock)

    def public_key(self) -> bytes:
        return self._public

    def is_revoked(self, token_id: str) -> bool:
        return self.store.token_revoked(token_id)

    # -- minting -------------------------------------------------------------------
    def _audit(self, module: str, action: str, resource: str, decision: str, reason: str,
               job: str | None) -> None:
        self.trail.record(AuditRecord(principal=module, action=action, resource=resource,
                                      decision=decision, reason=reason, job=job))  # type: ignore[arg-type]

    def _mint(self, module: str, job_id: str, role: str, scope: Scope, interfaces: frozenset[str],
              ttl_s: float, action: str = "token.mint",
              principal: str | None = None) -> tuple[str, Claims]:
        """`principal`: whom the audit names, when not the module (a rank, for the
        tokens of its data reader and metrics endpoint)."""
        token, claims = self._minter.mint(module, job_id, role, scope, interfaces, ttl_s,
                                          now=self.clock())
        self.store.record_token(job_id, claims.token_id, claims.expires_at)
        held = f"module={module} " if principal and principal != module else ""
        self._audit(principal or module, action, f"token/{claims.token_id}", "allow",
                    f"{held}role={role} ifaces={','.join(sorted(interfaces))} "
                    f"expires={int(claims.expires_at)}", job_id)
        return token, claims

    def trainer_scope(self, job_id: str, spec: JobSpec, gpus: tuple[int, ...]) -> Scope:
        # Normalised, not resolved: the path is the one every node sees, and
        # resolving symlinks here, on the head, could name another place.
        ckpt = checkpoint_dir(spec.checkpoint.path, job_id)
        return Scope(devices=tuple(gpus), groups=TRAINER_GROUPS, checkpoint_prefix=str(ckpt),
                     redis_prefix=keys.job(self.store.p, job_id) + ":")

    def grant_workers(self, job_id: str, ranks: dict[int, tuple[int, ...]]) -> dict[int, WorkerGrant]:
        """A trainer token per rank (scoped to its GPUs), a data_loader and a monitor
        token for its data reader and its metrics endpoint, and the job's Redis URL.

        The job's Redis user is created on first call and kept (same
        password) for later ranks: replacements and grown replicas.
        """
        spec = JobSpec.model_validate(self.store.get(job_id).spec)
        self.store.hold_credentials(job_id)
        url = self.job_redis_url(job_id)
        storage = self.storage.grant(job_id, spec)
        interfaces = TRAINER_BASE | frozenset(spec.permission.collectives)
        ttl = spec.permission.token_ttl_seconds
        out = {}
        for rank, gpus in ranks.items():
            name = f"{job_id}/rank-{rank}"
            token, _ = self._mint(name, job_id, "trainer", self.trainer_scope(job_id, spec, gpus),
                                  interfaces, ttl)
            modules = {role: self._mint(f"{name}/{module}", job_id, role, Scope(), ifaces, ttl,
                                        principal=name)[0]
                       for role, (module, ifaces) in RANK_MODULES.items()}
            out[rank] = WorkerGrant(token, self._public, url, modules, storage)
        return out

    def renew_storage(self, token: str) -> str | None:
        """Fresh object-store credentials for the job of a valid trainer token (the vendor
        mints new ones once the held ones are within 30 minutes of expiring)."""
        claims = self._verifier.verify(token)
        self._renewable(claims)
        if self.store.job_revoked(claims.job) or self._ended(claims.job):
            raise TokenError("revoked", f"job {claims.job} has ended; its tokens are revoked")
        return self.storage.grant(claims.job, JobSpec.model_validate(self.store.get(claims.job).spec))

    def grant_module(self, job_id: str, module: str, role: str) -> WorkerGrant:
        """A token for one of the job's other modules (its controller, a data
        loader, a monitor): the role's interfaces, the job's checkpoint prefix."""
        spec = JobSpec.model_validate(self.store.get(job_id).spec)
        self.store.hold_credentials(job_id)
        full = self.trainer_scope(job_id, spec, ())
        scope = Scope(checkpoint_prefix=full.checkpoint_prefix, redis_prefix=full.redis_prefix)
        token, _ = self._mint(f"{job_id}/{module}", job_id, role, scope, ROLE_INTERFACES[role],
                              spec.permission.token_ttl_seconds)
        return WorkerGrant(token, self._public, None)

    def job_redis_url(self, job_id: str) -> str | None:
        if not self.job_acl or not self.admin_url:
            return self.admin_url
        password = self.store.job_user_password(job_id)
        if password is None:
            password = self.store.grant_job_user(job_id)
            self._audit("token-authority", "redis.grant", f"redis-user/{redis_acl.job_user(job_id)}",
                        "allow", f"keys {keys.job(self.store.p, job_id)}[:*]", job_id)
        return redis_acl.url_for(self.admin_url, redis_acl.job_user(job_id), password)

    # -- checking, renewing, revoking ----------------------------------------------
    def verify(self, token: str) -> Claims:
        return self._verifier.verify(token)

    def renew(self, token: str) -> str:
        """A fresh token with the same claims, for one that is still valid.

        Raises:
            TokenError: For a token that is expired, revoked, tampered or not ours.
        """
        try:
            claims = self._verifier.verify(token)
            self._renewable(claims)
        except TokenError as exc:
            self._audit("unverified", "token.renew", "token", "deny", str(exc), None)
            raise
        new, fresh = self._mint(claims.module, claims.job, claims.role, claims.scope,
                                claims.interfaces, claims.expires_at - claims.issued_at,
                                action="token.renew")
        # `revoke_job` marks the job before it revokes the tokens it finds: a
        # renewal that raced it, and minted after it read them, sees the mark here.
        if self.store.job_revoked(claims.job) or self._ended(claims.job):
            self.revoke(fresh.token_id, "the job's tokens were revoked", fresh.expires_at,
                        job=claims.job, quiet=True)
            self._audit(claims.module, "token.renew", f"token/{claims.token_id}", "deny",
                        "the job's tokens were revoked while it renewed", claims.job)
            raise TokenError("revoked", f"job {claims.job} has ended; its tokens are revoked")
        self.revoke(claims.token_id, "renewed", claims.expires_at, job=claims.job, quiet=True)
        return new

    def _renewable(self, claims: Claims) -> None:
        """Refuse to renew a token this authority did not issue for a live job."""
        if claims.token_id not in self.store.issued_tokens(claims.job):
            raise TokenError("denied", f"token {claims.token_id} was not issued for job "
                                       f"{claims.job} by this authority (or the job's tokens "
                                       "were retired)")
        if self.store.job_revoked(claims.job) or self._ended(claims.job):
            raise TokenError("revoked", f"job {claims.job} has ended; its tokens are revoked")

    def revoke(self, token_id: str, reason: str, expires_at: float | None = None,
               job: str | None = None, quiet: bool = False) -> None:
        """Refuse a token from now on; the mark lasts until the token would expire anyway."""
        ttl = max(1, int((expires_at or self.clock() + 86400) - self.clock()) + 1)
        self.store.revoke_token(token_id, reason, ttl)
        if not quiet:
            self._audit("token-authority", "token.revoke", f"token/{token_id}", "allow", reason, job)

    def revoke_job(self, job_id: str, reason: str) -> int:
        """Revoke every token of a job; returns the tokens revoked.

        The job's Redis user goes too once the job has ended. While it runs, the
        user stays until the job ends (the sweep removes it): its ranks must
        still read the revocation marks, fail with the reason, and say so.
        """
        now = self.clock()
        # Marked first, so that a renewal racing this sees it (`renew`).
        self.store.mark_job_revoked(job_id, reason, MAX_TOKEN_TTL_S + 60)
        live = {tid: exp for tid, exp in self.store.issued_tokens(job_id).items() if exp > now}
        for tid, exp in live.items():
            self.revoke(tid, reason, exp, job=job_id, quiet=True)
        self.store.forget_tokens(job_id)
        if self._ended(job_id):
            self.store.release_credentials(job_id)
            self.storage.release(job_id)
        self._audit("token-authority", "token.revoke", f"job/{job_id}", "allow",
                    f"{reason}: {len(live)} live token(s)", job_id)
        if self.job_acl and self.admin_url and self._ended(job_id):
            try:
                self.store.revoke_job_user(job_id)
            except Exception as exc:  # never blocks the job's end; the audit says so
                log.warning("could not delete the Redis user of job %s: %s", job_id, exc)
            self.store.forget_job_user(job_id)
        return len(live)

    def sweep(self) -> list[str]:
        """Retire the credentials of jobs that have ended (or vanished); returns their ids.

        The controller retires them when it finishes a job; this catches the
        rest: a job cancelled while queued after a run, a controller that died.
        """
        done = []
        for job_id in self.store.credential_jobs():
            if self._ended(job_id):
                self.revoke_job(job_id, "the job ended")
                done.append(job_id)
        return done

    def restore_users(self) -> list[str]:
        """Create again, with their passwords, the Redis users of running jobs that
        Redis lost: ACL users are not in its data files, so a restarted Redis
        comes back with the jobs' keys but without their users. The ranks'
        clients retry their connections meanwhile, and get back in."""
        if not (self.job_acl and self.admin_url):
            return []
        restored = []
        for job_id in self.store.credential_jobs():
            password = self.store.job_user_password(job_id)
            if password is None or self.store.has_job_user(job_id):
                continue
            if self._ended(job_id):
                continue
            self.store.grant_job_user(job_id, password)
            self._audit("token-authority", "redis.grant", f"redis-user/{redis_acl.job_user(job_id)}",
                        "allow", "restored: Redis came back without it", job_id)
            restored.append(job_id)
        return restored

    def _ended(self, job_id: str) -> bool:
        try:
            return self.store.get(job_id).state.is_terminal
        except JobNotFound:
            return True

    def report_denial(self, token: str | None, interface: str, resource: str,
                      reason: str) -> None:
        """A worker's guard refused an interface: audit it under the module's name."""
        try:
            claims = self._verifier.verify(token)
            module, job = claims.module, claims.job
        except TokenError:
            module, job = "unverified", None
        self._audit(module, interface, resource, "deny", reason, job)
        if job:
            self.store.recorder(job).inc(
                metrics.TOKEN_DENIALS, job=job, interface=interface)
