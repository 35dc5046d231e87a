"""Who is calling the API and what they may do: API keys, roles, tenants, audit.

Every route but `/healthz` depends on `caller` (401 without a valid key) and,
for privileged actions, on `require(action)` (403 when the role lacks it). A
job of another tenant answers 404, exactly as a job that does not exist, so
that its existence does not leak. Every denial, and every allowed action that
changes state, leaves an audit record.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import lru_cache
from typing import Annotated, Any, TypeVar

from fastapi import Depends, HTTPException, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from kuangchao.api.server.dependencies.fresh import MISSING, Fresh
from kuangchao.api.server.dependencies.store import Store, get_store
from kuangchao.platform.errors import JobNotFound
from kuangchao.platform.jobs.state import JobRecord
from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.security.apikeys import Principal, StoredKey, authenticate, key_id_of
from kuangchao.platform.security.audit import AuditLog, AuditRecord, DenialSampler
from kuangchao.platform.security.job_audit import audit_path_of
from kuangchao.platform.security.keystore import KeyStore
from kuangchao.platform.settings import audit_file, audit_roots

ANONYMOUS = "anonymous"


@lru_cache(maxsize=4)
def _trail(store: JobStore) -> AuditLog:
    return AuditLog(store, audit_file(), audit_roots())


async def audit_log(store: Store) -> AuditLog:
    return _trail(store)


def keystore(store: JobStore) -> KeyStore:
    return KeyStore(store)


# Key records as read from Redis, by key id, for this long: a request costs no
# HGET and no parse. The secret's hash, revocation and expiry are still checked
# against the record on every request (`authenticate`). A key revoked through
# this process (`DELETE /v1/admin/keys/{id}`) is dropped at once (`forget_key`);
# one revoked by another process (another API worker, `kc up` rotating the
# bootstrap key) is refused within KEY_TTL_S. Unknown ids are not remembered: a
# key made a moment ago works on its first request.
KEY_TTL_S = 1.0
_keys = Fresh(KEY_TTL_S)


def stored_key(store: JobStore, key_id: str | None) -> StoredKey | None:
    """The record of `key_id`, read at most KEY_TTL_S ago."""
    if not key_id:
        return None
    got = _keys.get((store.p, key_id))
    if got is MISSING:
        got = keystore(store).get(key_id)
        if got is not None:
            _keys.put((store.p, key_id), got)
    return got


def forget_key(store: JobStore, key_id: str) -> None:
    """Drop the remembered record of `key_id` (it was just revoked here)."""
    _keys.drop((store.p, key_id))


# Refusals are sampled per source (see DenialSampler); every allow is written.
_denials = DenialSampler()


def audit(store: JobStore, who: Principal | str, action: str, resource: str, decision: str,
          reason: str = "", job: str | None = None, source: str | None = None) -> None:
    name = who if isinstance(who, str) else f"{who.name}[{who.tenant}/{who.key_id}]"
    if decision == "deny":
        write, skipped = _denials.admit(source or name, time.time())
        if not write:
            return
        if skipped:
            reason = f"{reason} ({skipped} more refusals from {source or name} were not written)"
    _trail(store).record(AuditRecord(principal=name, action=action, resource=resource,
                                     decision=decision, reason=reason, job=job))  # type: ignore[arg-type]


def bearer(header: str | None) -> str | None:
    """The key in `Authorization: Bearer <key>`; a header of another shape
    yields the header itself so that `authenticate` calls it malformed."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else header


# Declares the bearer scheme in /openapi.json; the header itself is parsed by
# `bearer` so that a malformed one gets its own message.
_SCHEME = HTTPBearer(auto_error=False, description="an API key: kc_<id>_<secret>")


def authenticate_request(store: JobStore, header: str | None, resource: str,
                         client: str | None) -> Principal:
    """The principal of an `Authorization` header.

    Raises:
        PermissionError: What is wrong with the key; the refusal is audited
            (sampled per client address, so a flood cannot flush the trail).
    """
    key = bearer(header)
    try:
        return authenticate(key, stored_key(store, key_id_of(key)))
    except PermissionError as exc:
        audit(store, key_id_of(key) or ANONYMOUS, "api.authenticate", resource, "deny", str(exc),
              source=f"client {client}" if client else None)
        raise


async def caller(request: Request,
                 _: Annotated[HTTPAuthorizationCredentials | None, Security(_SCHEME)] = None,
                 ) -> Principal:
    """The authenticated principal, or 401 (audited) saying what is wrong with the key.

    The edge (api/server/edge.py) has authenticated the request already; a
    route reached without it (an app built without the edge) checks here. No
    store dependency: each one FastAPI resolves costs every request some
    microseconds, and the store is needed only without the edge."""
    return await principal_of(request)


async def principal_of(request: Request, store: JobStore | None = None) -> Principal:
    """`caller`, for code that calls it directly (with the store it has, if any)."""
    principal = getattr(request.state, "principal", None)
    if principal is not None:
        return principal
    if store is None:
        store = await get_store()
    try:
        principal = authenticate_request(store, request.headers.get("authorization"),
                                         f"{request.method} {request.url.path}",
                                         request.client.host if request.client else None)
    except PermissionError as exc:
        raise HTTPException(status_code=401, detail=f"API key refused ({exc})",
                            headers={"WWW-Authenticate": "Bearer"}) from None
    request.state.principal = principal
    return principal


Caller = Annotated[Principal, Depends(caller)]


def require(action: str) -> Callable[..., Principal]:
    """A dependency: the caller, if their role may do `action`; else 403 (audited)."""

    async def check(request: Request, principal: Caller) -> Principal:
        if not principal.can(action):
            reason = f"role {principal.role} may not {action}"
            audit(await get_store(), principal, action, f"{request.method} {request.url.path}",
                  "deny", reason)
            raise HTTPException(status_code=403, detail=(
                f"{reason}; ask an admin for a key with a role that may "
                f"(`kc admin key create --role ...`)"))
        return principal

    return check


def visible_job(store: JobStore, principal: Principal, job_id: str, action: str) -> JobRecord:
    """The job, if it exists and the caller's tenant may see it; else 404.

    A hidden job answers exactly as a missing one. The attempt is audited.
    """
    try:
        job = store.get(job_id)
    except JobNotFound as exc:
        raise HTTPException(status_code=404, detail=exc.message) from None
    if not principal.sees(job.tenant):
        audit(store, principal, action, f"job/{job_id}", "deny",
              f"job belongs to tenant {job.tenant}", job=job_id)
        raise HTTPException(status_code=404, detail=JobNotFound.for_id(job_id).message)
    return job


def allowed(store: JobStore, principal: Principal, action: str, resource: str,
            job: str | None = None, **extra: Any) -> None:
    """Record an allowed state change."""
    reason = ", ".join(f"{k}={v}" for k, v in extra.items())
    audit(store, principal, action, resource, "allow", reason, job=job)


T = TypeVar("T")


def allowed_change(store: JobStore, principal: Principal, action: str, resource: str,
                   change: Callable[[str], T], job: JobRecord, **extra: Any) -> T:
    """Make an allowed change to a new `job` and record it, in one Redis round trip.

    `change(line)` makes the change and adds `line`, the audit record, to the
    audit stream in the same transaction (`store.create(job, audit_line=line)`);
    the audit file and the job's own copy are written after, as for `allowed`.
    A change that raises leaves no record: nothing was changed.
    """
    rec = AuditRecord(principal=f"{principal.name}[{principal.tenant}/{principal.key_id}]",
                      action=action, resource=resource, decision="allow",
                      reason=", ".join(f"{k}={v}" for k, v in extra.items()), job=job.id)
    trail = _trail(store)
    if trail.job_files is not None:  # the spec is at hand: no read of the record to find it
        trail.job_files.remember(job.id, audit_path_of(job.spec))
    line = trail.line(rec)
    out = change(line)
    trail.record(rec, streamed=True, line=line)
    return out
