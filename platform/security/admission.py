"""What a submitter may ask for: the ceilings of its role, the queues of its
tenant, and the folders jobs may read data from and write checkpoints to.

A spec is the submitter's to write, so nothing in it may be trusted to be
modest: `task.priority: 10**15` would preempt or shrink every other tenant's
job, any queue's quota could be spent, `max_restarts` and `data.max_bytes`
had no ceiling, and `data.path` and `checkpoint.path` could name any file the
workers can reach (`$KC_HOME/credentials`, another job's checkpoints,
`/dev/shm`).

- **Ceilings per role** come from the queue document's `limits:` (`kc up
  --queues`, `PUT /v1/queues`); a role it does not name gets `DEFAULT_LIMITS`.
- **Queues per tenant**: a queue with `tenants:` takes only those tenants'
  jobs; one without takes every tenant's.
- **Roots**: a `data.path` must lie under a data root, a `checkpoint.path`
  under a checkpoint root (`KC_DATA_ROOTS`, `KC_CHECKPOINT_ROOTS`, each a
  `:`-separated list; defaults `$KC_HOME/data` and `$KC_HOME`). Checked here
  on the path as written, normalised (the API may not see the workers'
  disks), and again by the worker on the path resolved, symlinks and all,
  before it opens anything (workers/data/corpus.py).
- **Object-store data**: a `data.path` that is a URL (`s3://bucket/prefix`, a
  glob such as `s3://bucket/d/*.jsonl`) must lie under one of the operator's
  prefixes (`KC_DATA_URLS`; none by default) and name a scheme this install
  can open. Checked on the URL as written, without asking the store; the rank
  copies it to its node's cache (workers/data/remote.py).

Pure: no Ray, Redis or torch.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from kuangchao.platform.errors import AdmissionRefused, SpecError
from kuangchao.platform.settings import roots_from  # noqa: F401 -- re-exported
from kuangchao.platform.storage import objects, urls


@dataclass(frozen=True)
class RoleLimits:
    """The most a job submitted by one role may ask for."""

    max_priority: int
    max_restarts: int
    max_data_bytes: int

    def to_json(self) -> dict[str, int]:
        return asdict(self)


# `high` is 100 (platform/spec/jobspec.py): submitters may use every named
# priority; operators may go above them, to jump a queue in an incident.
DEFAULT_LIMITS = {
    "viewer": RoleLimits(max_priority=0, max_restarts=0, max_data_bytes=0),
    "submitter": RoleLimits(max_priority=100, max_restarts=20, max_data_bytes=1 << 30),
    "operator": RoleLimits(max_priority=1000, max_restarts=100, max_data_bytes=64 << 30),
    "admin": RoleLimits(max_priority=1000, max_restarts=100, max_data_bytes=64 << 30),
}


def limits_from_json(doc: dict[str, Any] | None) -> dict[str, RoleLimits]:
    """The queue document's `limits:` over the defaults, role by role."""
    out = dict(DEFAULT_LIMITS)
    for role, fields in (doc or {}).items():
        out[role] = RoleLimits(**{**DEFAULT_LIMITS[role].to_json(), **fields})
    return out


def check_request(role: str, tenant: str, priority: int, queue_tenants: tuple[str, ...] | None,
                  queue: str, max_restarts: int, data_bytes: int | None,
                  limits: dict[str, RoleLimits]) -> None:
    """Refuse what the role or tenant may not ask for.

    Raises:
        AdmissionRefused: One `(field, message)` per refusal; the API answers 403.
    """
    cap = limits.get(role) or DEFAULT_LIMITS["viewer"]
    errors: list[tuple[str, str]] = []
    if queue_tenants is not None and tenant not in queue_tenants:
        errors.append(("task.queue", f"queue {queue!r} takes jobs of tenants "
                                     f"{', '.join(queue_tenants) or '(none)'}, not {tenant!r}; "
                                     "submit to another queue, or ask an operator"))
    if priority > cap.max_priority:
        errors.append(("task.priority", f"{priority} is above what role {role} may ask for "
                                        f"({cap.max_priority}); use at most that"))
    if max_restarts > cap.max_restarts:
        errors.append(("fault_tolerance.max_restarts", f"{max_restarts} is above what role "
                                                       f"{role} may ask for ({cap.max_restarts})"))
    if data_bytes is not None and data_bytes > cap.max_data_bytes:
        errors.append(("data.max_bytes", f"{data_bytes} is above what role {role} may ask for "
                                         f"({cap.max_data_bytes})"))
    if errors:
        raise AdmissionRefused(errors)


def under(path: str, roots: tuple[str, ...]) -> bool:
    """Whether `path` (absolute, normalised) is one of `roots` or inside one."""
    return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def check_paths(data_path: str | None, checkpoint_path: str, data_roots: tuple[str, ...],
                checkpoint_roots: tuple[str, ...], *, read_paths: tuple[tuple[str, str | None], ...] = (),
                audit_log: str | None = None, audit_roots: tuple[str, ...] = (),
                data_urls: tuple[str, ...] = (), checkpoint_urls: tuple[str, ...] = (),
                local_staging: str | None = None) -> None:
    """Refuse a data, model, checkpoint or audit path outside its roots, as written.

    `read_paths` are more `(field, path)` pairs the job reads, held to the data roots
    (a Hugging Face model's folder, a tokenizer). A glob in `data.path` is checked by
    the folder it starts in. A `data.path` that is an object-store URL is held to
    `data_urls` instead (`url_problem`).

    Raises:
        SpecError: Naming the field, the roots, and the setting that adds one.
    """
    errors = []
    orig_checkpoint = checkpoint_path
    if data_path is not None and urls.is_url(data_path):
        problem = url_problem(data_path, data_urls, "KC_DATA_URLS")
        if problem is not None:
            errors.append(("data.path", problem))
        data_path = None
    if urls.is_url(checkpoint_path):
        problem = url_problem(checkpoint_path, checkpoint_urls, "KC_CHECKPOINT_URLS")
        if problem is not None:
            errors.append(("checkpoint.path", problem))
        # A relative staging folder lies under each node's own folder; an absolute one
        # is held to the checkpoint roots as a checkpoint folder would be.
        checkpoint_path = local_staging if local_staging and os.path.isabs(
            os.path.expanduser(local_staging)) else None
    checks = [("data.path", _glob_base(data_path), data_roots, "KC_DATA_ROOTS"),
              *((field, raw, data_roots, "KC_DATA_ROOTS") for field, raw in read_paths),
              ("checkpoint.local_staging" if urls.is_url(orig_checkpoint) else "checkpoint.path",
               checkpoint_path, checkpoint_roots, "KC_CHECKPOINT_ROOTS"),
              ("permission.audit_log", audit_log, audit_roots, "KC_AUDIT_ROOT")]
    for field, raw, roots, setting in checks:
        if raw is None:
            continue
        path = os.path.normpath(os.path.abspath(os.path.expanduser(raw)))
        if not under(path, roots):
            errors.append((field, f"{raw!r} is outside the folders jobs may use here "
                                  f"({', '.join(roots)}); put it under one of them, or ask an "
                                  f"operator to add a root ({setting})"))
    if errors:
        raise SpecError(errors)


def url_problem(url: str, prefixes: tuple[str, ...], setting: str) -> str | None:
    """Why the object-store `url` (a glob allowed after its bucket) may not be used,
    or None: a scheme not installed here, a malformed URL or pattern, or a place
    outside `prefixes` (the URLs the operator listed in `setting`). No network."""
    try:
        base, _ = split_url_glob(url)
    except ValueError as exc:
        return str(exc)
    problem = objects.check_scheme(base)
    if problem is not None:
        return problem
    if not prefixes:
        return (f"{url!r} is in an object store, and this cluster lets jobs read none; use a "
                f"local path, or ask an operator to allow a prefix ({setting})")
    if not urls.under_prefixes(base, prefixes):
        return (f"{url!r} is outside the object-store prefixes jobs may use here "
                f"({', '.join(prefixes)}); put it under one of them, or ask an operator to add "
                f"a prefix ({setting})")
    return None


def split_url_glob(url: str) -> tuple[str, str | None]:
    """An object-store URL as (the prefix before its first wildcard's segment, the
    pattern after it, or None when it has no wildcard):
    `s3://b/d/*.jsonl` -> (`s3://b/d`, `*.jsonl`).

    Raises:
        ValueError: A wildcard in the bucket, or a pattern segment that is empty,
            `.` or `..` (it would reach outside the prefix), saying which.
    """
    at = min((i for i in (url.find(c) for c in "*?[") if i >= 0), default=-1)
    if at < 0:
        return url, None
    scheme_end = url.find("://")
    cut = url.rfind("/", 0, at)
    if scheme_end < 0 or cut <= scheme_end + 2:
        raise ValueError(f"{url!r}: a wildcard may not stand in the bucket name; name the bucket, "
                         "then a pattern (s3://bucket/folder/*.jsonl)")
    pattern = url[cut + 1:]
    if any(s in ("", ".", "..") or "\\" in s or "\0" in s for s in pattern.split("/")):
        raise ValueError(f"{url!r}: the pattern {pattern!r} has an empty, '.' or '..' segment or "
                         "a backslash; write it plainly (s3://bucket/folder/**/*.jsonl)")
    return url[:cut], pattern


def _glob_base(path: str | None) -> str | None:
    """The part of a glob before its first wildcard's folder (`/d/*.jsonl` -> `/d`)."""
    if path is None or not any(c in path for c in "*?["):
        return path
    head = path[:min(i for i in (path.find(c) for c in "*?[") if i >= 0)]
    return os.path.dirname(head) or "."
