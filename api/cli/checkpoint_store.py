"""`kc checkpoint list|verify|export` on checkpoints kept in an object store.

The target is a job's prefix (`s3://bucket/prefix/<job id>`), one step of it
(`…/step_00000200`), or a job id whose `checkpoint.path` is a URL. `list` reads
manifests and object sizes only (no download), so it shows at once which
checkpoints are whole in the store; `verify` and `export` fetch the step into
this machine's cache first and check every file's checksum there, as a rank
does before it restores. kc uses the operator's credentials (the standard AWS
environment).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from kuangchao.platform.errors import StorageError
from kuangchao.platform.protocol.checkpoint import step_dir_name, step_of
from kuangchao.platform.storage.access import cache_dir, open_filesystem
from kuangchao.platform.storage.mirror import RemoteCheckpoints
from kuangchao.platform.storage.objects import probe
from kuangchao.platform.storage.urls import ObjectUrl, is_url, parse
from kuangchao.workers.errors import CheckpointError


def open_target(url: str) -> tuple[RemoteCheckpoints, int | None]:
    """The job prefix `url` names and the step it names, if any.

    Raises:
        StorageError: Not a URL kc can open, with what to pass instead.
    """
    try:
        target = parse(url)
    except ValueError as exc:
        raise StorageError(str(exc)) from None
    parent, _, name = target.key.rpartition("/")
    step = step_of(Path(name)) if name else None
    job = ObjectUrl(target.scheme, target.bucket, parent) if step is not None else target
    if not job.key:
        raise StorageError(f"{url} names a bucket, not a job's checkpoints; pass "
                           "s3://bucket/prefix/<job id> (or one step_* under it)")
    return RemoteCheckpoints(job, open_filesystem(job.scheme)), step


def describe(store: RemoteCheckpoints, step: int) -> dict[str, Any]:
    """One step in the store: whether its manifest is there and every object at its size."""
    where = str(store.step_url(step))
    try:
        manifest = store.shallow_verify(step)
        reason = None
    except CheckpointError as exc:
        reason = exc.message
        try:
            manifest = store.manifest(step)
        except CheckpointError:
            manifest = None
    size = sum(int(m.get("bytes", 0)) for m in manifest["files"].values()
               if isinstance(m, dict)) if manifest else 0
    return {"step": step, "path": where, "bytes": size,
            "created_at": manifest.get("created_at") if manifest else None,
            "verified": reason is None, "reason": reason,
            "format": manifest.get("format") if manifest else None}


def rows(url: str) -> list[dict[str, Any]]:
    """One row per step of `url` (see `describe`).

    Raises:
        StorageError: The bucket does not exist, or the store refused or did not answer.
    """
    store, step = open_target(url)
    steps = [step] if step is not None else store.committed_steps()
    if not steps:  # nothing there, or no such bucket: say which
        problem = probe(str(store.url))
        if problem is not None:
            raise StorageError(problem)
    return [describe(store, s) for s in steps]


def fetch_newest(url: str) -> tuple[Path, dict[str, Any]]:
    """The step `url` names, or the job's newest committed one, fetched into this
    machine's cache and verified there (every checksum): (local folder, its row).

    Raises:
        CheckpointError: Nothing committed, or the step is incomplete or corrupt.
    """
    store, step = open_target(url)
    if step is None:
        steps = store.committed_steps()
        if not steps:
            raise CheckpointError(f"no checkpoints in {store.url}; a job writes its first one "
                                  "after `checkpoint.interval_steps` steps")
        step = steps[-1]
    digest = hashlib.sha256(str(store.url).encode()).hexdigest()[:16]
    local = cache_dir("kc-checkpoint") / digest / step_dir_name(step)
    manifest = store.fetch(step, local)
    row = describe(store, step)
    row.update(verified=True, reason=None, format=manifest.get("format"))
    return local, row


def job_url(root: str, job_id: str) -> str | None:
    """`{root}/{job_id}` when a job's `checkpoint.path` is a URL, else None."""
    return str(parse(root).join(job_id)) if is_url(root) else None
