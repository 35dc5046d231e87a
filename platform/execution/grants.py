"""The controller's side of capability tokens: fetch each rank's credentials
from the token authority, and retire the job's when it ends."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import ray

from kuangchao.platform.errors import ClusterError, KuangchaoError, TokenError
from kuangchao.platform.security.authority import AUTHORITY_NAME
from kuangchao.platform.security.tokens import (
    Claims,
    Verifier,
    check,
    load_public,
    within_prefix,
    within_url_prefix,
)
from kuangchao.platform.settings import RAY_NAMESPACE, Settings
from kuangchao.platform.storage.urls import is_url
from kuangchao.workers.checkpoint.paths import anchor, check_step_folder, leads_inside

log = logging.getLogger(__name__)


def worker_settings(settings: Settings, grant: dict[str, Any]) -> Settings:
    """What a rank is handed: the job's Redis user instead of the admin's, and no
    API key, signing key or its path."""
    return dataclasses.replace(settings, redis_url=grant.get("redis_url") or settings.redis_url,
                               api_key=None, signing_key_file=None, signing_key_pem=None,
                               object_store_env=None)


class Credentials:
    """One job's credentials, as its controller handles them.

    Args:
        job_id: The job.
        authority: The token authority's actor; found by name on first use when None.
    """

    def __init__(self, job_id: str, authority: Any = None, store: Any = None) -> None:
        self.job_id = job_id
        self.authority = authority
        self.store = store  # the admin store: where the control-plane credential is kept
        self.own_claims: Claims | None = None

    def _credential(self) -> str:
        """The control plane's credential for the authority (admin Redis only)."""
        secret = self.store.control_secret() if self.store is not None else None
        if not secret:
            raise ClusterError("the control plane's credential for the token authority is not in "
                               "Redis; is the token authority running? (`kc up` starts it)")
        return secret

    def _authority(self) -> Any:
        if self.authority is None:
            try:
                self.authority = ray.get_actor(AUTHORITY_NAME, namespace=RAY_NAMESPACE)
            except ValueError:
                raise ClusterError("no token authority is running, and no rank may start "
                                   "without a token; start the control plane with `kc up`") from None
        return self.authority

    def grants(self, ranks_gpus: dict[int, tuple[int, ...]]) -> dict[int, dict[str, Any]]:
        """Fresh credentials for these ranks (each with the GPUs it was planned):
        a token each, the public key, the job's Redis URL."""
        authority = self._authority()
        if not ranks_gpus:
            return {}
        return ray.get(authority.grant_workers.remote(self._credential(), self.job_id, ranks_gpus),
                       timeout=60)

    def public_key(self) -> str:
        """The token authority's public key (PEM): what the job's keepers verify with."""
        return str(ray.get(self._authority().info.remote(), timeout=60)["public_key"])

    def _claims(self) -> Claims:
        """The controller's own token (role `controller`), verified with the public key."""
        if self.own_claims is None:
            authority = self._authority()
            grant = ray.get(authority.grant_module.remote(self._credential(), self.job_id,
                                                          "controller", "controller"), timeout=60)
            self.own_claims = Verifier(load_public(grant["public_key"].encode())).verify(
                grant["token"])
        return self.own_claims

    def within_job(self, path: Path | str) -> Path | str:
        """`path` if it lies in the job's checkpoint folder, as the controller's token
        scopes it; a final checkpoint elsewhere (another job's) never counts, nor
        one reached through a symlink the job's code planted, nor one holding a
        symlink (CheckpointError: verify would follow it)."""
        claims = self._claims()
        prefix = claims.scope.checkpoint_prefix
        try:
            check(claims, "checkpoint_read")
            if is_url(prefix) or is_url(str(path)):  # an object store: no symlinks to follow
                return within_url_prefix(prefix, str(path))
            full = Path(within_prefix(prefix, str(path)))
        except TokenError as exc:
            raise KuangchaoError(f"the final checkpoint {path} is not this job's: {exc.message}; "
                                 "save it with ctx.checkpoint") from None
        if not leads_inside(full, anchor(prefix)):
            raise KuangchaoError(f"the final checkpoint {path} is not this job's: it leads outside "
                                 f"{prefix} through a symlink; save it with ctx.checkpoint")
        check_step_folder(full, anchor(prefix))
        return full

    def retire(self, store: Any) -> None:
        """Once the job has ended, revoke its tokens and remove its Redis user.

        A job going back to the queue keeps them: its next run asks for fresh
        tokens, and the tokens of this run's ranks die with their processes
        or expire. The authority's sweep catches what is missed here.
        """
        if self.authority is None:
            return
        try:
            state = store.get(self.job_id).state
            if state.is_terminal:
                ray.get(self.authority.revoke_job.remote(self._credential(), self.job_id,
                                                         f"job {state.value}"), timeout=30)
        except Exception as exc:
            log.warning("job %s: credentials not retired now (%s); the authority's sweep will",
                        self.job_id, exc)
