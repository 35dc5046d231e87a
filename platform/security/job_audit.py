"""A job's own copy of its audit records: the file its spec names in `permission.audit_log`.

The trusted process that writes the main trail (the API, the token authority,
a `kc train` driver: whoever holds an `AuditLog`) appends every record whose
`job` is set to that job's file too, as the same JSON line. Ranks never write
it. Admission (platform/security/admission.py) refused any `audit_log` outside
the operator's audit roots (`KC_AUDIT_ROOT`) as written; here, at each write,
the path is held to them again, on disk:

- the path as written, normalised, must lie under an audit root;
- the folders below that root are walked one at a time from a descriptor of
  the root, each opened with O_NOFOLLOW: a symlink planted at any of them (or
  at the file) after admission fails the write instead of redirecting it;
  missing folders are made, mode 0700;
- the file is opened O_WRONLY|O_APPEND|O_CREAT|O_NOFOLLOW, mode 0600, and must
  be a regular file (O_NONBLOCK, so that a planted FIFO fails rather than
  blocks).

Each job's `audit_log` is looked up once in its record (records come often)
and kept, a bounded number of jobs at a time. A job not found yet is looked up
again on its next record. Failures raise `OSError` (or `_Refused`, one of
them); `AuditLog.record` logs them as warnings and keeps the main record.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections import OrderedDict
from typing import Any

from kuangchao.platform.security.admission import roots_from, under

# Jobs whose `audit_log` is remembered; the least recently used is dropped past this.
CACHE_JOBS = 4096
_MISSING = object()


class _Refused(OSError):
    """A job's audit file that must not be written (outside the roots, not a regular file)."""


def audit_path_of(spec: dict[str, Any] | None) -> str | None:
    """`permission.audit_log` of a stored spec dict, or None."""
    perm = (spec or {}).get("permission")
    path = perm.get("audit_log") if isinstance(perm, dict) else None
    return path if isinstance(path, str) and path else None


def _root_for(path: str, roots: tuple[str, ...]) -> str | None:
    """The innermost root that `path` lies under (the path itself excluded)."""
    inside = [r for r in roots if path != r and under(path, (r,))]
    return max(inside, key=len) if inside else None


def _same(a: str, b: str) -> bool:
    norm = [os.path.normpath(os.path.abspath(os.path.expanduser(p))) for p in (a, b)]
    return norm[0] == norm[1] or os.path.realpath(norm[0]) == os.path.realpath(norm[1])


def _open_dir(name: str, parent: int | None) -> int:
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(name, flags) if parent is None else os.open(name, flags, dir_fd=parent)


def append_line(raw_path: str, line: str, roots: tuple[str, ...]) -> None:
    """Append `line` to the audit file `raw_path` (as the spec gives it) under `roots`.

    Raises:
        _Refused: The path is not under an audit root, or is not a regular file.
        OSError: A folder or the file could not be made or opened (a symlink planted
            below the root is ELOOP or ENOTDIR), or the write failed.
    """
    path = os.path.normpath(os.path.abspath(os.path.expanduser(raw_path)))
    root = _root_for(path, roots)
    if root is None:
        raise _Refused(errno.EACCES, f"outside the audit roots ({', '.join(roots)}); "
                                            "set permission.audit_log under KC_AUDIT_ROOT", path)
    *folders, name = os.path.relpath(path, root).split(os.sep)
    if name in ("", ".", "..") or ".." in folders:  # normpath leaves none; never walk up
        raise _Refused(errno.EACCES, "not a file below an audit root", path)
    os.makedirs(root, mode=0o700, exist_ok=True)
    # The root itself is the operator's and may be a symlink (/var/log -> /data/log);
    # everything below it is the job's to name, and is never followed.
    fd = _open_dir(os.path.realpath(root), None)
    try:
        for folder in folders:
            try:
                os.mkdir(folder, 0o700, dir_fd=fd)
            except FileExistsError:
                pass
            nxt = _open_dir(folder, fd)
            os.close(fd)
            fd = nxt
        flags = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                 | os.O_CLOEXEC)
        out = os.open(name, flags, 0o600, dir_fd=fd)
    finally:
        os.close(fd)
    try:
        if not stat.S_ISREG(os.fstat(out).st_mode):
            raise _Refused(errno.EACCES, "not a regular file", path)
        data = line.encode()
        while data:  # O_APPEND: each write lands at the end
            data = data[os.write(out, data):]
    finally:
        os.close(out)


class JobAuditFiles:
    """Finds a job's `permission.audit_log` in its record and appends lines to it.

    Args:
        store: Anything with `get(job_id)` returning a record with a `spec` dict
            (the job store, or the in-memory one).
        roots: The audit roots (`platform.settings.audit_roots()`, from `KC_AUDIT_ROOT`).
    """

    def __init__(self, store: Any, roots: tuple[str, ...], cache_jobs: int = CACHE_JOBS) -> None:
        self.store = store
        self.roots = roots_from(os.pathsep.join(roots), ()) if roots else ()
        self.cache_jobs = cache_jobs
        self._paths: OrderedDict[str, str | None] = OrderedDict()
        self._lock = threading.Lock()

    def path_for(self, job_id: str) -> str | None:
        """The job's audit file as its spec names it; None without one (or no such job yet).

        Raises:
            Exception: Whatever the store raised other than a missing job (not remembered).
        """
        with self._lock:
            got = self._paths.get(job_id, _MISSING)
            if got is not _MISSING:
                self._paths.move_to_end(job_id)
                return got  # type: ignore[return-value]
        from kuangchao.platform.errors import JobNotFound

        try:
            record = self.store.get(job_id)
        except JobNotFound:
            return None  # not stored yet (or never): asked again next time
        path = audit_path_of(getattr(record, "spec", None))
        self.remember(job_id, path)
        return path

    def remember(self, job_id: str, path: str | None) -> None:
        """Note the job's `audit_log` (None: it names none), known to the caller
        (its submitter holds the spec), so that its first record reads no record."""
        with self._lock:
            self._paths[job_id] = path
            while len(self._paths) > self.cache_jobs:
                self._paths.popitem(last=False)

    def append(self, job_id: str, line: str, skip: str | os.PathLike[str] | None = None) -> str | None:
        """Append `line` (a JSON record, newline included) to the job's file, if it names one.

        `skip`: the main trail's file; a job naming it gets no second copy there.

        Returns:
            The path written, or None when the job names no audit file (or names `skip`).

        Raises:
            OSError: The file could not be written (_Refused: must not be).
        """
        raw = self.path_for(job_id)
        if raw is None or (skip is not None and _same(raw, os.fspath(skip))):
            return None
        append_line(raw, line, self.roots)
        return raw
