"""The controller's side of capability tokens: fetch each rank's credentials
from the token authority, and retire the job's when it ends."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import ray

from kuangchao.platform.authority import AUTHORITY_NAME
from kuangchao.platform.errors import ClusterError
from kuangchao.platform.settings import RAY_NAMESPACE, Settings

log = logging.getLogger(__name__)


def worker_settings(settings: Settings, grant: dict[str, Any]) -> Settings:
    """What a rank is handed: the job's Redis user instead of the admin's, and no
    API key or signing-key path."""
    return dataclasses.replace(settings, redis_url=grant.get("redis_url") or settings.redis_url,
                               api_key=None, signing_key_file=None)


class Credentials:
    """Mixin for `JobController`: needs `job_id`, `planned`, `store` and `authority`."""

    job_id: str
    planned: list[Any]
    store: Any
    authority: Any

    def _grants(self, ranks: list[int]) -> dict[int, dict[str, Any]]:
        """Fresh credentials for these ranks: a token each, the public key, the job's Redis URL."""
        if self.authority is None:
            try:
                self.authority = ray.get_actor(AUTHORITY_NAME, namespace=RAY_NAMESPACE)
            except ValueError:
                raise ClusterError("no token authority is running, and no rank may start "
                                   "without a token; start the control plane with `kc up`") from None
        ranks_gpus = {r: tuple(self.planned[r] or ()) for r in ranks}
        return ray.get(self.authority.grant_workers.remote(self.job_id, ranks_gpus), timeout=60)

    def _retire_credentials(self) -> None:
        """Once the job has ended, revoke its tokens and remove its Redis user.

        A job going back to the queue keeps them: its next run asks for fresh
        tokens, and the tokens of this run's ranks die with their processes
        or expire. The authority's sweep catches what is missed here.
        """
        if self.authority is None:
            return
        try:
            state = self.store.get(self.job_id).state
            if state.is_terminal:
                ray.get(self.authority.revoke_job.remote(self.job_id, f"job {state.value}"),
                        timeout=30)
        except Exception as exc:
            log.warning("job %s: credentials not retired now (%s); the authority's sweep will",
                        self.job_id, exc)
