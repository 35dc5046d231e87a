"""The token authority's Ray actor, in a module of its own.

Every rank receives a handle to this actor, and Ray imports an actor's class
module wherever one of its handles is unpickled. Kept apart from `actors.py`
(the scheduler, the registry, the job controller), a rank loads only this
shell and the authority, which its token checks import anyway.

Ray lets any code in the cluster call any named actor, rank code included, so
the actor itself tells callers apart: minting and revoking take the control
plane's credential, a random secret kept in the admin Redis (`auth:control`),
which the scheduler and the controllers read and the ranks' Redis users cannot.
A rank can only renew a token it holds (`TokenAuthority.renew`) and report a
denial. Refused calls are audited (sampled, so that a loop of them cannot
flush the trail).
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from typing import Any

import ray

from kuangchao.platform.errors import TokenError
from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.observability.logjson import use_json_logs
from kuangchao.platform.security.audit import AuditLog, AuditRecord, DenialSampler
from kuangchao.platform.security.authority import TokenAuthority, load_signing_key
from kuangchao.platform.security.tokens import generate_key
from kuangchao.platform.settings import Settings, audit_file, audit_roots
from kuangchao.platform.storage.access import apply_operator_env

log = logging.getLogger(__name__)

# How often the authority retires the credentials of jobs that have ended, and
# how often it checks that Redis still has the running jobs' users.
SWEEP_S = 30.0
RESTORE_S = 1.0


class TokenAuthorityActor:
    """Hosts the token authority. With `ephemeral`, a key of its own that dies
    with it: a `kc train` driver without a control plane makes one for its job."""

    def __init__(self, settings: Settings, ephemeral: bool = False) -> None:
        use_json_logs("authority")
        apply_operator_env(settings.object_store_env)  # per-job object-store credentials
        store = JobStore.from_url(settings.redis_url, settings.redis_prefix)
        key, self.key_source = ((generate_key(), "ephemeral") if ephemeral else
                                load_signing_key(settings.signing_key_file, settings.dev,
                                                 settings.signing_key_pem))
        self.authority = TokenAuthority(store, key, AuditLog(store, audit_file(), audit_roots()),
                                        settings.redis_url, job_acl=settings.job_acl)
        self.store = store
        self._control = store.offer_control_secret(secrets.token_urlsafe(32))
        self._refusals = DenialSampler()
        self._stop = threading.Event()
        threading.Thread(target=self._sweep, daemon=True, name="kc-authority-sweep").start()

    def _sweep(self) -> None:
        next_sweep = time.monotonic() + SWEEP_S
        while not self._stop.wait(RESTORE_S):
            try:
                # A restarted Redis may have lost the control credential; the
                # controllers that read it before still hold this one.
                if self.store.control_secret() != self._control:
                    self.store.offer_control_secret(self._control)
                self.authority.restore_users()
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + SWEEP_S
                    self.authority.sweep()
            except Exception as exc:  # Redis away: try again on the next beat
                log.warning("token authority upkeep failed (%s); retrying", exc)

    def _control_plane(self, credential: str | None, action: str, job_id: str) -> None:
        """Refuse (audited) a call without the control plane's credential.

        Raises:
            TokenError: Saying that the call is the control plane's alone.
        """
        if isinstance(credential, str) and hmac.compare_digest(credential, self._control):
            if self.store.job_revoked(job_id) and action != "revoke_job":
                raise TokenError("revoked", f"job {job_id}'s tokens were revoked; it gets no "
                                            "new ones")
            return
        write, skipped = self._refusals.admit(f"authority.{action}", time.time())
        if write:
            more = f" ({skipped} more not written)" if skipped else ""
            self.authority.trail.record(AuditRecord(
                principal="unverified", action=f"authority.{action}", resource=f"job/{job_id}",
                decision="deny", reason="no control-plane credential" + more, job=job_id))
        raise TokenError("denied", f"the token authority's {action} is the control plane's "
                                   "alone; a rank may only renew its own token")

    def grant_workers(self, credential: str, job_id: str,
                      ranks: dict[int, tuple[int, ...]]) -> dict[int, dict]:
        self._control_plane(credential, "grant_workers", job_id)
        return {r: g.to_json() for r, g in self.authority.grant_workers(job_id, ranks).items()}

    def grant_module(self, credential: str, job_id: str, module: str, role: str) -> dict:
        self._control_plane(credential, "grant_module", job_id)
        return self.authority.grant_module(job_id, module, role).to_json()

    def renew(self, token: str) -> str:
        return self.authority.renew(token)

    def renew_storage(self, token: str) -> str | None:
        return self.authority.renew_storage(token)

    def revoke_job(self, credential: str, job_id: str, reason: str) -> int:
        self._control_plane(credential, "revoke_job", job_id)
        return self.authority.revoke_job(job_id, reason)

    def report_denial(self, token: str | None, interface: str, resource: str, reason: str) -> None:
        self.authority.report_denial(token, interface, resource, reason)

    def info(self) -> dict[str, Any]:
        return {"key": self.key_source, "public_key": self.authority.public_key().decode()}


def private_authority(settings: Settings) -> Any:
    """A token authority owned by the caller, with an ephemeral key (for `kc train`
    on a Ray cluster without a kuangchao control plane)."""
    actor = ray.remote(TokenAuthorityActor).options(num_cpus=0).remote(settings, True)
    ray.get(actor.info.remote(), timeout=120)
    return actor
