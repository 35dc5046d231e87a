"""API keys and roles: who is calling, and what each role may do.

A key is `kc_<id>_<secret>`. Only the id and a SHA-256 of the whole key are
kept; the key is shown once, when it is created. The secret is 32 random
bytes, so a plain hash is enough: no dictionary of guesses can reach it, and
checking it costs microseconds on every request. Comparison is constant-time.

Pure: the store keeps the records; the API asks `authenticate` and `allowed`.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Any

ROLES = ("admin", "operator", "submitter", "viewer")
# What each role may do. Tenancy narrows jobs further: a principal sees only
# its own tenant's jobs unless its role reads across tenants.
PERMISSIONS: dict[str, frozenset[str]] = {
    "viewer": frozenset({"job.read"}),
    "submitter": frozenset({"job.read", "job.submit", "job.cancel", "job.scale", "job.debug"}),
    "operator": frozenset({"job.read", "job.submit", "job.cancel", "job.scale", "job.debug",
                           "queue.manage",
                           "node.manage", "audit.read", "jobs.all_tenants", "metrics.read"}),
    "admin": frozenset({"job.read", "job.submit", "job.cancel", "job.scale", "job.debug",
                        "queue.manage",
                        "node.manage", "audit.read", "jobs.all_tenants", "metrics.read",
                        "key.manage"}),
}
_KEY = re.compile(r"^kc_([0-9a-f]{16})_([A-Za-z0-9_-]{43})$")


@dataclass(frozen=True)
class Principal:
    """Who a key speaks for."""

    key_id: str
    name: str
    tenant: str
    role: str
    created_at: float = field(default_factory=time.time)
    revoked_at: float | None = None
    expires_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def can(self, action: str) -> bool:
        return action in PERMISSIONS.get(self.role, frozenset())

    def sees(self, tenant: str | None) -> bool:
        """Whether this principal may know that a job of `tenant` exists."""
        return self.can("jobs.all_tenants") or tenant == self.tenant


@dataclass(frozen=True)
class StoredKey:
    principal: Principal
    digest: str  # sha256 hex of the whole key


def new_key(name: str, tenant: str, role: str,
            ttl_s: float | None = None) -> tuple[str, StoredKey]:
    """A fresh key (to show once) and what to store; with `ttl_s`, it expires.

    Raises:
        ValueError: For an unknown role, an empty name or tenant, or a ttl <= 0.
    """
    if ttl_s is not None and ttl_s <= 0:
        raise ValueError(f"a key's lifetime must be positive, not {ttl_s}")
    if role not in ROLES:
        raise ValueError(f"role {role!r} is unknown; use one of {', '.join(ROLES)}")
    if not name or not tenant:
        raise ValueError("a key needs a name and a tenant")
    key_id = secrets.token_hex(8)
    key = f"kc_{key_id}_{secrets.token_urlsafe(32)}"
    now = time.time()
    principal = Principal(key_id, name, tenant, role, created_at=now,
                          expires_at=None if ttl_s is None else now + ttl_s)
    return key, StoredKey(principal, _digest(key))


def stored_key(key: str, name: str, tenant: str, role: str) -> StoredKey:
    """What to store for a key made elsewhere (a deployment's generated Secret).

    Raises:
        ValueError: For a malformed key, an unknown role, an empty name or tenant.
    """
    m = _KEY.match(key)
    if m is None:
        raise ValueError("an API key looks like kc_<16 lowercase hex>_<43 characters of "
                         "A-Z a-z 0-9 _ ->")
    if role not in ROLES:
        raise ValueError(f"role {role!r} is unknown; use one of {', '.join(ROLES)}")
    if not name or not tenant:
        raise ValueError("a key needs a name and a tenant")
    return StoredKey(Principal(m.group(1), name, tenant, role, created_at=time.time()),
                     _digest(key))


def key_id_of(key: str | None) -> str | None:
    """The id part of a well-formed key, else None (malformed or missing)."""
    m = _KEY.match(key or "")
    return m.group(1) if m else None


def authenticate(key: str | None, stored: StoredKey | None, now: float | None = None) -> Principal:
    """The principal of `key`, given the stored record of its id.

    Raises:
        PermissionError: Saying whether the key is missing, malformed, unknown
            (or wrong), or revoked; the API answers 401.
    """
    if not key:
        raise PermissionError("missing: send the API key as `Authorization: Bearer kc_...`")
    if key_id_of(key) is None:
        raise PermissionError("malformed: an API key looks like kc_<16 hex>_<43 characters>")
    if stored is None:
        raise PermissionError("unknown: no such API key; ask an admin for one "
                              "(`kc admin key create`)")
    p = stored.principal
    if not hmac.compare_digest(stored.digest, _digest(key)):
        raise PermissionError(f"tampered: the secret does not match key {p.key_id}")
    if p.revoked_at is not None:
        raise PermissionError(f"revoked: key {p.key_id} was revoked; ask an admin for a new one")
    now = time.time() if now is None else now
    if p.expires_at is not None and now >= p.expires_at:
        raise PermissionError(f"expired: key {p.key_id} expired at "
                              f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(p.expires_at))}; "
                              "ask an admin for a new one")
    return p


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
