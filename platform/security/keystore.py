"""API key records in Redis: one hash field per key id, holding the principal
and the SHA-256 of the key (never the key itself).

Revoking keeps the record, marked with the time, so that `kc admin key list`
and the audit trail can still name whose key it was.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from kuangchao.platform.security.apikeys import Principal, StoredKey, new_key, stored_key

BOOTSTRAP_NAME = "kc-up-admin"
DEPLOY_NAME = "deploy-admin"


class KeyStore:
    """Typed access to the API key records (`auth:keys`).

    Args:
        store: The job store (its `api_key`, `put_api_key`, `api_key_records`).
    """

    def __init__(self, store: Any) -> None:
        self.store = store

    def get(self, key_id: str | None) -> StoredKey | None:
        if not key_id:
            return None
        raw = self.store.api_key(key_id)
        return _load(raw) if raw else None

    def create(self, name: str, tenant: str, role: str,
               ttl_s: float | None = None) -> tuple[str, Principal]:
        """A new key (shown once) and its principal.

        Raises:
            ValueError: For an unknown role, an empty name or tenant, a ttl <= 0.
        """
        key, stored = new_key(name, tenant, role, ttl_s)
        self.store.put_api_key(stored.principal.key_id, _dump(stored))
        return key, stored.principal

    def list(self, include_revoked: bool = False) -> list[Principal]:
        out = [_load(raw).principal for raw in self.store.api_key_records()]
        if not include_revoked:
            out = [p for p in out if p.revoked_at is None]
        return sorted(out, key=lambda p: p.created_at)

    def revoke(self, key_id: str) -> Principal | None:
        """Mark a key revoked; None when there is no such key. Idempotent."""
        stored = self.get(key_id)
        if stored is None:
            return None
        if stored.principal.revoked_at is None:
            principal = dataclasses.replace(stored.principal, revoked_at=time.time())
            stored = StoredKey(principal, stored.digest)
            self.store.put_api_key(key_id, _dump(stored))
        return stored.principal

    def bootstrap_admin(self) -> str:
        """A fresh admin key for `kc up`; earlier bootstrap keys are revoked so
        that a restarted stack leaves no stale admin key behind."""
        for p in self.list():
            if p.name == BOOTSTRAP_NAME:
                self.revoke(p.key_id)
        key, _ = self.create(BOOTSTRAP_NAME, "default", "admin")
        return key

    def register(self, key: str, name: str = DEPLOY_NAME, tenant: str = "default",
                 role: str = "admin") -> Principal:
        """Store a key made outside (a deployment's Secret) and revoke every other
        key of the same name, so rotating the Secret retires the old key. Idempotent.

        Raises:
            ValueError: For a malformed key, or one revoked earlier (a rotated-out
                key is never brought back).
        """
        stored = stored_key(key, name, tenant, role)
        kid = stored.principal.key_id
        current = self.get(kid)
        if current is not None:
            if current.digest != stored.digest:
                raise ValueError(f"key id {kid} is taken by another key; generate a new key")
            if current.principal.revoked_at is not None:
                raise ValueError(f"key {kid} was revoked; put a newly generated key in its place")
        else:
            self.store.put_api_key(kid, _dump(stored))
            current = stored
        for p in self.list():
            if p.name == name and p.key_id != kid:
                self.revoke(p.key_id)
        return current.principal


def _dump(stored: StoredKey) -> str:
    return json.dumps({"principal": stored.principal.to_json(), "digest": stored.digest})


def _load(raw: str) -> StoredKey:
    d = json.loads(raw)
    return StoredKey(Principal(**d["principal"]), d["digest"])
