"""A Redis ACL user per job: its workers reach their own job's keys and nothing else.

The user may read and write `{prefix}job:{id}:*`, only read the job's record
`{prefix}job:{id}` (two patterns: a bare `job:{id}*` would also match a job
whose id merely starts with this one), read token revocation marks and the
job's fence set (`{prefix}fenced:{id}`, the rank processes the controller
replaced: a fenced rank must not be able to take itself out), and run
transactions; nothing that lists, flushes or administers the server, and no
scripts. The record is read-only because it holds the job's tenant, priority,
queue, GPU count, state and spec, which the token authority and the scheduler
trust: ranks never change job state (the controller does), and a rank's code
that could would raise its own priority or rewrite its own spec. Scripts are
out because one endless script blocks every client of the server. Its
password is random and lives only in the job's worker environment; workers
never see the admin credentials.
"""

from __future__ import annotations

import secrets
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from kuangchao.platform.jobs import keys

# Categories first, then the exceptions: later ACL rules win.
_RULES = ("resetchannels", "-@all", "+@read", "+@write", "+@connection", "+@transaction",
          "-@scripting", "-@dangerous", "-@admin", "-scan", "-keys", "-randomkey")


def job_user(job_id: str) -> str:
    return f"kc-job-{job_id}"


def grant_job_user(admin: Any, prefix: str, job_id: str,
                   password: str | None = None) -> tuple[str, str]:
    """Create (or reset) the job's ACL user; returns its name and password (a new
    random one unless `password` is given, as when restoring it)."""
    name, password = job_user(job_id), password or secrets.token_urlsafe(32)
    # Revocation marks are readable (not writable), so workers can see that a
    # token of theirs was revoked; so is the job's fence set, so a rank can see
    # that it was replaced, and can never take itself out of it.
    admin.execute_command("ACL", "SETUSER", name, "reset", "on", f">{password}",
                          f"%R~{keys.job(prefix, job_id)}", f"~{keys.job_prefix(prefix, job_id)}*",
                          f"%R~{keys.revoked(prefix, '*')}", f"%R~{keys.fenced(prefix, job_id)}",
                          *_RULES)
    return name, password


def has_job_user(admin: Any, job_id: str) -> bool:
    return admin.execute_command("ACL", "GETUSER", job_user(job_id)) is not None


def revoke_job_user(admin: Any, job_id: str) -> None:
    admin.execute_command("ACL", "DELUSER", job_user(job_id))


def url_for(admin_url: str, user: str, password: str) -> str:
    """The admin URL with the job user's credentials in place of the admin's."""
    parts = urlsplit(admin_url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
