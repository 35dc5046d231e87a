"""Capability tokens: what one module of a job may do, signed by the token authority.

A token is a JWT signed with Ed25519 (PyJWT over `cryptography`; nothing
home-made). The authority alone holds the private key; every other process
gets only the public key, so it can check a token but never mint one. A token
names one module of one job, its role, the resources it may touch (devices,
communication groups, a checkpoint path prefix, a Redis key prefix) and the
interfaces it may call, and it expires. Anything not granted is denied.

Pure: no Ray, no Redis. Revocation is a callable the caller backs with the
store; the authority actor and the enforcement points are thin shells.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kuangchao.platform.errors import TokenError
from kuangchao.platform.protocol.interfaces import INTERFACES
from kuangchao.platform.storage.urls import is_url
from kuangchao.platform.storage.urls import parse as parse_url

ALGORITHM = "EdDSA"
ISSUER = "kuangchao"
# Reading the training data: a data reader's interface alone (no trainer carries it).
DATASET_READ = "dataset_read"
# The most each role may ever be granted; a token may carry less (least privilege).
ROLE_INTERFACES: dict[str, frozenset[str]] = {
    "trainer": INTERFACES - {"metrics_read"},
    "data_loader": frozenset({DATASET_READ, "checkpoint_read", "heartbeat"}),
    "monitor": frozenset({"metrics_read", "heartbeat"}),
    "controller": frozenset({"checkpoint_read", "heartbeat", "metrics_read"}),
}
# A token is renewed once this share of its lifetime has passed.
RENEW_AT = 0.8


@dataclass(frozen=True)
class Scope:
    """The resources a token covers. Empty tuples grant nothing of that kind."""

    devices: tuple[int, ...] = ()
    groups: tuple[str, ...] = ()
    checkpoint_prefix: str = ""
    redis_prefix: str = ""


@dataclass(frozen=True)
class Claims:
    module: str
    job: str
    role: str
    scope: Scope
    interfaces: frozenset[str]
    issued_at: float
    expires_at: float
    token_id: str = field(default_factory=lambda: secrets.token_hex(12))

    def payload(self) -> dict[str, Any]:
        s = self.scope
        return {"iss": ISSUER, "sub": self.module, "job": self.job, "role": self.role,
                "scope": {"devices": list(s.devices), "groups": list(s.groups),
                          "checkpoint_prefix": s.checkpoint_prefix,
                          "redis_prefix": s.redis_prefix},
                "ifaces": sorted(self.interfaces), "iat": int(self.issued_at),
                "exp": int(self.expires_at), "jti": self.token_id}

    @classmethod
    def from_payload(cls, p: dict[str, Any]) -> Claims:
        try:
            s = p["scope"]
            return cls(module=str(p["sub"]), job=str(p["job"]), role=str(p["role"]),
                       scope=Scope(devices=tuple(int(d) for d in s["devices"]),
                                   groups=tuple(str(g) for g in s["groups"]),
                                   checkpoint_prefix=str(s["checkpoint_prefix"]),
                                   redis_prefix=str(s["redis_prefix"])),
                       interfaces=frozenset(str(i) for i in p["ifaces"]),
                       issued_at=float(p["iat"]), expires_at=float(p["exp"]),
                       token_id=str(p["jti"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise TokenError("malformed", f"the token's claims are incomplete ({exc!r})") from None

    def needs_renewal(self, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        return now >= self.issued_at + RENEW_AT * (self.expires_at - self.issued_at)


# -- keys ------------------------------------------------------------------------

def generate_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def private_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def public_pem(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(serialization.Encoding.PEM,
                            serialization.PublicFormat.SubjectPublicKeyInfo)


def load_private(pem: bytes) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError("the signing key is not an Ed25519 private key")
    return key


def load_public(pem: bytes) -> Ed25519PublicKey:
    key = serialization.load_pem_public_key(pem)
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError("the verification key is not an Ed25519 public key")
    return key


# -- minting and checking ----------------------------------------------------------

class Minter:
    """Mints tokens; only the token authority holds one."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key

    def mint(self, module: str, job: str, role: str, scope: Scope, interfaces: Iterable[str],
             ttl_s: float, now: float | None = None) -> tuple[str, Claims]:
        """A signed token and its claims.

        Raises:
            ValueError: For an unknown role, or interfaces the role may not have.
        """
        allowed = ROLE_INTERFACES.get(role)
        if allowed is None:
            raise ValueError(f"role {role!r} is unknown; use one of {sorted(ROLE_INTERFACES)}")
        wanted = frozenset(interfaces)
        extra = wanted - allowed
        if extra:
            raise ValueError(f"role {role} may not be granted {sorted(extra)}")
        now = time.time() if now is None else now
        claims = Claims(module=module, job=job, role=role, scope=scope, interfaces=wanted,
                        issued_at=now, expires_at=now + ttl_s)
        return jwt.encode(claims.payload(), self._key, algorithm=ALGORITHM), claims


class Verifier:
    """Checks tokens with the public key alone.

    Args:
        key: The authority's public key.
        is_revoked: Whether a token id was revoked (backed by the store).
        clock: The time to judge expiry by.
    """

    def __init__(self, key: Ed25519PublicKey, is_revoked: Callable[[str], bool] = lambda _: False,
                 clock: Callable[[], float] = time.time) -> None:
        self._key, self._is_revoked, self._clock = key, is_revoked, clock

    def verify(self, token: str | None) -> Claims:
        """The token's claims, or `TokenError` saying why it is refused."""
        if not token:
            raise TokenError("missing", "no token was presented")
        try:
            payload = jwt.decode(token, self._key, algorithms=[ALGORITHM], issuer=ISSUER,
                                 options={"verify_exp": False, "require": ["exp", "jti", "iat"]})
        except jwt.InvalidSignatureError:
            raise TokenError("tampered", "the signature does not match the claims") from None
        except (jwt.DecodeError, jwt.InvalidTokenError) as exc:
            raise TokenError("malformed", f"not a kuangchao token ({exc})") from None
        claims = Claims.from_payload(payload)
        if self._clock() >= claims.expires_at:
            raise TokenError("expired", f"token {claims.token_id} expired at "
                                        f"{time.strftime('%H:%M:%S', time.localtime(claims.expires_at))}")
        if self._is_revoked(claims.token_id):
            raise TokenError("revoked", f"token {claims.token_id} was revoked")
        return claims


def check(claims: Claims, interface: str, group: str | None = None,
          device: int | None = None) -> None:
    """Default deny: `interface` must be granted, and the group and device in scope.

    Raises:
        TokenError: ("denied") naming what was asked and what the token grants.
    """
    if interface not in claims.interfaces:
        raise TokenError("denied", f"{claims.module} may not call {interface}; its token grants "
                                   f"{', '.join(sorted(claims.interfaces)) or 'nothing'}")
    if group is not None and group not in claims.scope.groups:
        raise TokenError("denied", f"{claims.module} is not a member of communication group "
                                   f"{group!r}")
    if device is not None and device not in claims.scope.devices:
        raise TokenError("denied", f"{claims.module} may not use device {device}")


def check_role(claims: Claims, role: str, interface: str) -> None:
    """`claims` must be a `role` token granting `interface` (a rank's data reader
    asks a data_loader token, its metrics endpoint a monitor token).

    Raises:
        TokenError: ("denied") for a token of another role, or without `interface`.
    """
    if claims.role != role:
        raise TokenError("denied", f"{claims.module} holds a {claims.role} token, and {interface} "
                                   f"takes a {role} token")
    check(claims, interface)


def check_devices(claims: Claims, devices: Iterable[int], planned: bool = True) -> tuple[int, ...]:
    """The GPU ids a rank is about to take must be exactly its token's `scope.devices`,
    none more and none fewer; returns them, sorted. A CPU rank takes none, and its
    token's scope names none.

    `planned=False`: a node without per-GPU resources, where Ray picks the GPUs as
    the rank starts, so the plan, and with it the token, could name none. There an
    empty scope passes whatever Ray picked; a scope that names GPUs must still match.

    Raises:
        TokenError: ("denied") naming the devices asked and the devices granted.
    """
    used = tuple(sorted({int(d) for d in devices}))
    granted = tuple(sorted(set(claims.scope.devices)))
    if used == granted or (not planned and not granted):
        return used
    raise TokenError("denied", f"{claims.module} may not use GPU(s) {_ids(used)}; its token's "
                               f"device scope is {_ids(granted)}")


def _ids(ids: tuple[int, ...]) -> str:
    return ", ".join(map(str, ids)) or "none"


def within_url_prefix(prefix: str, url: str) -> str:
    """`url` (normalised) if it is the object-store prefix `prefix` or lies beneath it.

    The URL is taken apart first (urls.parse refuses `..`, empty and `.`
    segments, which a store keeps as literal keys), so no spelling of another
    job's prefix passes; a local path against a URL prefix, or the reverse, never does.

    Raises:
        TokenError: ("denied") naming the URL and the prefix.
    """
    try:
        root, target = parse_url(prefix), parse_url(url)
    except ValueError as exc:
        raise TokenError("denied", f"checkpoint location {url!r}: {exc}") from None
    if not root.contains(target):
        raise TokenError("denied", f"checkpoint location {url!r} is outside {prefix}")
    return str(target)


def within_prefix(prefix: str, path: str) -> PurePosixPath:
    """`path` as an absolute path inside `prefix`, refusing `..` and anything outside.

    Raises:
        TokenError: ("denied") for a traversal or a path outside the prefix.
    """
    if not prefix:
        raise TokenError("denied", "the token grants no checkpoint path")
    if is_url(prefix) or is_url(path):
        within_url_prefix(prefix, path)
        return PurePosixPath(path)  # never used as a local path: callers check is_url first
    if ".." in PurePosixPath(path).parts:
        raise TokenError("denied", f"checkpoint path {path!r} contains '..'")
    root = PurePosixPath(prefix)
    full = PurePosixPath(path) if PurePosixPath(path).is_absolute() else root / path
    if full != root and root not in full.parents:
        raise TokenError("denied", f"checkpoint path {path!r} is outside {prefix}")
    return full
