"""The token authority's part in object storage: each job's store credentials,
granted with its ranks' tokens, renewed before they expire, released when the
job ends, and every decision audited.

Split from authority.py; the credentials themselves (STS, a per-job role, the
prefix policy) are object_credentials.py's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kuangchao.platform.errors import StorageError
from kuangchao.platform.security.admission import split_url_glob
from kuangchao.platform.security.object_credentials import ObjectCredentialVendor
from kuangchao.platform.spec.jobspec import JobSpec
from kuangchao.platform.storage.urls import is_url
from kuangchao.platform.storage.urls import parse as parse_url

log = logging.getLogger(__name__)

# audit(module, action, resource, decision, reason, job_id), as TokenAuthority._audit.
Audit = Callable[[str, str, str, str, str, "str | None"], None]


class StorageGrants:
    """Object-store credentials per job, through one vendor made at the first store job."""

    def __init__(self, audit: Audit, spec_of: Callable[[str], dict | None]) -> None:
        """`spec_of(job_id)`: the job's stored spec, or None when it is gone."""
        self._audit, self._spec_of = audit, spec_of
        self._vendor: ObjectCredentialVendor | None = None

    def grant(self, job_id: str, spec: JobSpec) -> str | None:
        """The job's credentials for its ranks (StoreCredentials JSON), or None when it names
        no store: read-write on `{checkpoint.path}/{job_id}`, read-only on an object-store
        `data.path`. A refusal is audited and raised with what to change.

        Raises:
            StorageError: The store could not scope credentials (object_credentials.py).
        """
        path = spec.checkpoint.path
        write = str(parse_url(path).join(job_id)) if is_url(path) else None
        data = spec.data.path if spec.data.path and is_url(spec.data.path) else None
        reads = (split_url_glob(data)[0],) if data else ()
        if write is None and not reads:
            return None
        if self._vendor is None:
            self._vendor = ObjectCredentialVendor()
        # No checkpoint prefix in a store: the data's own prefix, read-only in effect
        # (the job writes nothing there: its checkpoints are on disk).
        where = write or reads[0]
        try:
            creds = self._vendor.grant(job_id, where, reads if write else ())
        except StorageError as exc:
            self._audit("token-authority", "storage.grant", f"objects/{where}", "deny",
                        exc.message, job_id)
            raise
        self._audit("token-authority", "storage.grant", f"objects/{where}", "allow",
                    f"scope={creds.scope} reads={','.join(reads) or '-'} "
                    f"expires={int(creds.expires_at or 0)}", job_id)
        return creds.to_json()

    def release(self, job_id: str) -> None:
        """Delete the job's role, if one was made; audited, never raises (a job's end
        must not wait on the store). A job that named no store asks nothing."""
        try:
            doc = self._spec_of(job_id) or {}
        except Exception:  # the record is gone: ask only if this process granted it
            doc = {} if self._vendor is None else {"checkpoint": {"path": "s3://?"}}
        paths = [(doc.get("checkpoint") or {}).get("path"), (doc.get("data") or {}).get("path")]
        if not any(isinstance(p, str) and is_url(p) for p in paths):
            return
        if self._vendor is None:
            self._vendor = ObjectCredentialVendor()
        try:
            if self._vendor.release(job_id):
                self._audit("token-authority", "storage.release", f"objects/job/{job_id}",
                            "allow", "job ended: its role deleted", job_id)
        except StorageError as exc:
            log.warning("could not release job %s's object-store role: %s", job_id, exc.message)
            self._audit("token-authority", "storage.release", f"objects/job/{job_id}", "deny",
                        exc.message, job_id)
