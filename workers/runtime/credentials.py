"""A rank's capability token in use: verified, renewed, watched for revocation,
and checked before collectives and checkpoint access.

The rank holds the authority's public key only, so it can check its token but
never mint one. A background thread renews the token through the authority
at 80 % of its lifetime and re-reads the revocation mark every few seconds; a
revoked or expired token takes every right away at once. A refusal raises
`PermissionError`, is written to the job's events, and is reported to the
authority, which audits it.

Besides the trainer token, the holder keeps the tokens of the rank's other
modules: its data reader's (role data_loader, asked before a corpus is read or
batches are prefetched) and its metrics endpoint's (role monitor, asked before
the endpoint is served). Both run in the rank's process, as threads, so they
share its memory: their tokens say what each module is for, and the holder
checks them where the module starts, but cannot fence one thread off from
another. They are renewed with the trainer's, and verified (revocation
included) each time they are asked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kuangchao.platform.errors import TokenError
from kuangchao.platform.protocol.checkpoint import step_of
from kuangchao.platform.security.tokens import (
    DATASET_READ,
    Claims,
    Verifier,
    check,
    check_devices,
    check_role,
    load_public,
    within_prefix,
    within_url_prefix,
)
from kuangchao.platform.storage.urls import is_url
from kuangchao.workers import collectives
from kuangchao.workers.checkpoint.manager import CheckpointManager
from kuangchao.workers.checkpoint.paths import anchor, leads_inside
from kuangchao.workers.data import corpus

# How often the revocation mark is read; a revoked token stops working within this.
REVOCATION_CHECK_S = 2.0


class TokenHolder:
    """This process's token.

    Args:
        token: The signed token the authority granted this rank.
        public_key: The authority's public key, PEM.
        is_revoked: Whether a token id carries a revocation mark (Redis, read-only).
        renew: Trades a valid token for a fresh one (the authority).
        on_deny: Told (interface, resource, reason) of each refusal.
        modules: The tokens of the rank's other modules, by role (data_loader,
            monitor). Given, even empty, this process reads data only under a
            data_loader token; None (tools, tests): data reads are not asked.
    """

    def __init__(self, token: str, public_key: bytes | str, is_revoked: Callable[[str], bool],
                 renew: Callable[[str], str], on_deny: Callable[[str, str, str], None],
                 modules: dict[str, str] | None = None) -> None:
        pem = public_key.encode() if isinstance(public_key, str) else public_key
        self._verifier = Verifier(load_public(pem), is_revoked)
        # Asked where a module starts: a Redis outage then must not fail the rank;
        # the background loop still reads the trainer token's mark.
        self._module_verifier = Verifier(load_public(pem), self._revoked_if_known)
        self._renew, self._is_revoked, self._on_deny = renew, is_revoked, on_deny
        self.token = token
        try:
            self.claims: Claims = self._verifier.verify(token)
        except TokenError as exc:  # the rank must not start; the audit says why
            on_deny("token", "token", str(exc))
            raise
        self.last_error: str | None = None
        self.modules: dict[str, str] = dict(modules or {})
        self._module_claims: dict[str, Claims] = {}
        for role, module_token in self.modules.items():
            try:
                self._module_claims[role] = self._module_verifier.verify(module_token)
            except TokenError:
                pass  # refused, and reported, when the module asks for it
        self._guards_reads = modules is not None
        if self._guards_reads:
            corpus.set_read_guard(self._permit_read)
        collectives.set_token(self.claims, on_deny=self._collective_denied)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="kc-token")
        self._thread.start()

    def _collective_denied(self, interface: str, group: str, reason: str) -> None:
        self._on_deny(interface, f"group/{group}", reason)

    def _revoked_if_known(self, token_id: str) -> bool:
        try:
            return self._is_revoked(token_id)
        except Exception:  # Redis away: the token holds till it expires
            return False

    def _loop(self) -> None:
        while not self._stop.wait(min(REVOCATION_CHECK_S, self._lifetime() / 20)):
            self._renew_modules()
            try:
                if self.claims.needs_renewal():
                    new = self._renew(self.token)
                    self.claims, self.token = self._verifier.verify(new), new
                    collectives.set_token(self.claims)
                elif self._is_revoked(self.claims.token_id):
                    self._refused(TokenError("revoked", f"token {self.claims.token_id} was revoked"))
            except TokenError as exc:  # refused: no more rights, and the job's events say why
                self._refused(exc)
            except Exception as exc:
                # The authority or Redis away (a Redis restart drops the job's user until
                # the authority restores it): try again; the token holds till it expires.
                self.last_error = f"{type(exc).__name__}: {exc}"

    def _renew_modules(self) -> None:
        for role, claims in list(self._module_claims.items()):
            if not claims.needs_renewal():
                continue
            try:
                new = self._renew(self.modules[role])
                self._module_claims[role] = self._module_verifier.verify(new)
                self.modules[role] = new
            except TokenError:  # refused: the module's next ask fails and says why
                del self._module_claims[role]
            except Exception:  # the authority away: try again on the next beat
                pass

    def _refused(self, exc: TokenError) -> None:
        if self.last_error == str(exc):
            return  # said once is enough
        self.last_error = str(exc)
        collectives.withdraw(exc)
        self._on_deny("token", f"token/{self.claims.token_id}", str(exc))

    def _lifetime(self) -> float:
        return max(1.0, self.claims.expires_at - self.claims.issued_at)

    def check_path(self, interface: str, path: str | Path) -> Path:
        """`path` if this token may `interface` (checkpoint_read/write) it; else PermissionError.

        Inside the prefix as written (tokens.within_prefix, pure) and where it leads,
        symlinks resolved: one planted inside the prefix (to another job's folder,
        say) is refused, and so is a prefix that is itself a symlink."""
        try:
            check(collectives.valid_claims(), interface)
            prefix = self.claims.scope.checkpoint_prefix
            if is_url(prefix) or is_url(str(path)):  # an object-store prefix: no symlinks there
                within_url_prefix(prefix, str(path))
                return Path(str(path))
            full = Path(within_prefix(prefix, str(path)))
            if not leads_inside(full, anchor(prefix)):
                raise TokenError("denied", f"checkpoint path {str(path)!r} leads outside {prefix} "
                                           "through a symlink")
            return full
        except TokenError as exc:
            self._on_deny(interface, f"path/{path}", str(exc))
            raise

    def permit_module(self, role: str, interface: str, resource: str) -> Claims:
        """The claims of this rank's `role` token if it verifies (signature, expiry,
        revocation) and grants `interface`; else reported, and PermissionError."""
        try:
            module_token = self.modules.get(role)
            if module_token is None:
                raise TokenError("missing", f"{self.claims.module} holds no {role} token")
            claims = self._module_verifier.verify(module_token)
            check_role(claims, role, interface)
            return claims
        except TokenError as exc:
            self._on_deny(interface, resource, str(exc))
            raise

    def _permit_read(self, what: str) -> None:
        self.permit_module("data_loader", DATASET_READ, f"dataset/{what}")

    def check_devices(self, devices: Iterable[int], planned: bool = True) -> tuple[int, ...]:
        """The GPU ids this rank is about to take, if its token's device scope is
        exactly them (`tokens.check_devices`); else reported, and PermissionError."""
        devices = tuple(devices)
        try:
            return check_devices(collectives.valid_claims(), devices, planned)
        except TokenError as exc:
            self._on_deny("devices", "devices/" + (",".join(map(str, devices)) or "none"),
                          str(exc))
            raise

    def stop(self) -> None:
        self._stop.set()
        collectives.set_token(None)
        if self._guards_reads:
            corpus.set_read_guard(None)


class GuardedCheckpoints(CheckpointManager):
    """A checkpoint manager that asks the rank's token before it reads or writes.

    The folder must lie inside the token's checkpoint prefix (no `..`, nothing
    outside), and the token must grant checkpoint_write to save and
    checkpoint_read to load or list.
    """

    def __init__(self, *args: Any, holder: TokenHolder, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.holder = holder
        holder.check_path("checkpoint_read", self.location)

    def save(self, *args: Any, **kw: Any):
        self.holder.check_path("checkpoint_write", self.location)
        return super().save(*args, **kw)

    def save_async(self, *args: Any, **kw: Any):
        self.holder.check_path("checkpoint_write", self.location)
        return super().save_async(*args, **kw)

    def latest_verified(self):
        self.holder.check_path("checkpoint_read", self.location)
        return super().latest_verified()

    def verify(self, path: Path):
        self._check_read(path)
        return super().verify(path)

    def load(self, path: Path, *args: Any, **kw: Any):
        return super().load(self._check_read(path), *args, **kw)

    def _check_read(self, path: Path) -> Path:
        """A step folder of this job's: the store's step URL when the checkpoints are
        in an object store (its local copy is this node's own), else the path."""
        if self.remote is None:
            return self.holder.check_path("checkpoint_read", path)
        step = step_of(Path(path))
        if step is None or Path(path).parent != self.dir:
            raise PermissionError(f"{path} is not a local copy of a checkpoint of {self.location}")
        self.holder.check_path("checkpoint_read", str(self.remote.store.step_url(step)))
        return Path(path)


# A rank asks for fresh object-store credentials once the ones it holds have less
# than this left (the authority's vendor mints new ones within 30 minutes of expiry),
# and asks again every STORAGE_RETRY_S until it gets them.
STORAGE_RENEW_BEFORE_S = 40 * 60
STORAGE_RETRY_S = 60.0


def renew_storage_in_background(holder: TokenHolder, handle: Any,
                                stop: threading.Event) -> threading.Thread:
    """Keep this rank's object-store credentials fresh through the token authority
    (`renew_storage`, which checks the rank's token), on a daemon thread, until `stop`."""
    import ray

    from kuangchao.platform.storage.access import job_credentials, use_job_credentials
    from kuangchao.platform.storage.objects import StoreCredentials

    def loop() -> None:
        while True:
            creds = job_credentials()
            if creds is None or creds.expires_at is None:
                return
            wait = max(0.0, creds.expires_at - STORAGE_RENEW_BEFORE_S - time.time())
            if stop.wait(max(wait, 1.0)):
                return
            try:
                fresh = ray.get(handle.renew_storage.remote(holder.token), timeout=30)
                if fresh:
                    renewed = StoreCredentials.from_json(fresh)
                    if renewed != creds:
                        use_job_credentials(renewed)
                        continue
            except Exception:  # the authority away, or the job ended: try again later
                pass
            if stop.wait(STORAGE_RETRY_S):
                return

    thread = threading.Thread(target=loop, daemon=True, name="kc-storage-renew")
    thread.start()
    return thread


def authority_client(handle: Any, timeout_s: float = 30.0) -> tuple[Callable[[str], str],
                                                                    Callable[..., None]]:
    """`renew` and `report` callables over the token authority's actor handle."""
    import ray

    def renew(token: str) -> str:
        try:
            return ray.get(handle.renew.remote(token), timeout=timeout_s)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.as_instanceof_cause()
            if isinstance(cause, TokenError | PermissionError):
                raise TokenError(getattr(cause, "reason", "denied"),
                                 getattr(cause, "message", str(cause))) from None
            raise

    def report(token: str | None, interface: str, resource: str, reason: str) -> None:
        handle.report_denial.remote(token, interface, resource, reason)  # fire and forget

    return renew, report
