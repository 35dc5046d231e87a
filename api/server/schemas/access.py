"""Responses of `/v1/whoami`, `/v1/admin/keys` and `/v1/audit`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kuangchao.api.server.schemas.common import Number, Passthrough, Public


class PrincipalPublic(Public):
    """Who a key speaks for (`Principal`); never the key itself."""

    key_id: str
    name: str
    tenant: str
    role: str
    created_at: Number
    revoked_at: Number | None
    expires_at: Number | None


class _Secret(Public):
    key: str = Field(description="kc_<id>_<secret>: shown once, store it now")


class KeyCreated(PrincipalPublic, _Secret):
    """A new key, then its principal: the only answer that ever holds the key."""


class KeyList(Public):
    keys: list[PrincipalPublic]


class WhoAmI(PrincipalPublic):
    permissions: list[str] = Field(description="the actions the key's role may do, sorted")


class AuditRecordPublic(Passthrough):
    """One audit record (`AuditRecord`). The trail outlives releases, so a
    record written by another version may carry keys this one does not."""

    principal: str
    action: str
    resource: str
    decision: Literal["allow", "deny"]
    reason: str
    job: str | None
    ts: Number


class AuditList(Public):
    records: list[AuditRecordPublic]
