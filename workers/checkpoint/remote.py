"""Checkpoints whose `checkpoint.path` is an object-store URL (s3://…): how a
save reaches the store, and where each node keeps its local copies.

Every rank writes its DCP shards and rank file to a folder of its own on its own
node (`.step_X.rN.tmp`: nothing is shared between nodes, not even a disk),
checksumming them on the way out as on disk; then uploads them itself, so the
upload is spread over ranks as the write is. Once every rank has uploaded, rank 0
uploads the manifest: the commit (platform/storage/mirror.py). With
`checkpoint.local_staging` the written files stay on the node as the local copy
that a restore there reads instead of downloading them again; without it they are
deleted once uploaded.

Split from writer.py (the phases every save goes through) and manager.py (when
saves run); imported only for URL checkpoint paths.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kuangchao.platform.protocol.checkpoint import step_dir_name, step_of
from kuangchao.platform.storage import access, mirror
from kuangchao.platform.storage.mirror import TRANSFER_THREADS, RemoteCheckpoints
from kuangchao.platform.storage.urls import parse
from kuangchao.workers import fence
from kuangchao.workers.errors import CheckpointError

# Local step folders a node keeps beyond the newest one; the store keeps `keep_last`.
LOCAL_KEEP = 1


def remote_for(root: str, job_id: str) -> RemoteCheckpoints:
    """The store side of `job_id`'s checkpoints under the URL `root`, opened with this
    process's credentials (a rank's are its job's, scoped to its prefix)."""
    url = parse(root).join(job_id)
    return RemoteCheckpoints(url, access.open_filesystem(url.scheme))


def local_dir(root: str, job_id: str, staging: str | None) -> Path:
    """Where this node keeps the local copies of a job's checkpoints under URL `root`:
    `{staging}/{job_id}` (a relative staging folder is under this node's own folder,
    `access.node_dir()`), or a cache folder of this node's named after the URL."""
    if staging:  # relative: under this node's own folder
        return access.node_dir() / Path(staging).expanduser() / job_id
    digest = hashlib.sha256(root.rstrip("/").encode()).hexdigest()[:16]
    return access.cache_dir("checkpoints") / digest / job_id


class RemoteTarget:
    """The remote half of one manager's saves: set on `SaveJob.remote` for URL roots."""

    def __init__(self, store: RemoteCheckpoints, staging: bool,
                 on_event: Callable[[dict[str, Any]], Any] | None = None) -> None:
        self.store, self.staging, self.on_event = store, staging, on_event

    def on_retry(self, attempt: int, what: str, error: str) -> None:
        """An upload failed and is tried again: the job hears of it."""
        if self.on_event is not None:
            self.on_event({"type": "checkpoint_retry", "attempt": attempt,
                           "message": f"{what}: try {attempt} failed ({error}); retrying"})

    def paths(self, folder: Path) -> list[Path]:
        """The local folders of the store's committed steps, oldest first (not fetched)."""
        return [folder / step_dir_name(s) for s in self.store.committed_steps()]

    def fetch(self, path: Path) -> dict[str, Any]:
        """Fetch the step `path` names into it and verify it there; its manifest."""
        step = step_of(path)
        if step is None:
            raise CheckpointError(f"{path} is not a step folder of {self.store.url}")
        return self.store.fetch(step, path)

    def start_prune(self, keep_last: int, keep: Path) -> threading.Thread:
        """`prune_store` on a daemon thread: the next commit waits for it."""
        step = step_of(keep)
        thread = threading.Thread(target=self.prune_store,
                                  args=(keep_last, step if step is not None else -1),
                                  name="kc-checkpoint-prune", daemon=True)
        thread.start()
        return thread

    def tmp_for(self, folder: Path, step: int, rank: int) -> Path:
        """Each rank's own write folder: ranks of one node never share one."""
        return folder / f".{step_dir_name(step)}.r{rank}.tmp"

    def prepare(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

    def session(self, step: int, started: float) -> UploadSession:
        """The uploads of one save, from its first closed shard to its last file."""
        return UploadSession(self, step, started + mirror.UPLOAD_DEADLINE_S)

    def commit(self, step: int, manifest: dict[str, Any], started: float) -> None:
        self.store.commit(step, manifest, self.on_retry,
                          deadline=started + mirror.UPLOAD_DEADLINE_S)

    def settle_local(self, tmp: Path, final: Path) -> None:
        """After the commit: keep this rank's files as the node's local copy (staging), or
        drop them. Local copies beyond the newest `LOCAL_KEEP` + 1 are removed."""
        if not self.staging:
            shutil.rmtree(tmp, ignore_errors=True)
            return
        final.mkdir(parents=True, exist_ok=True)
        for f in tmp.iterdir():
            os.replace(f, final / f.name)
        shutil.rmtree(tmp, ignore_errors=True)
        self.prune_local(final.parent, keep=final)

    def prune_local(self, folder: Path, keep: Path) -> None:
        steps = sorted(p for p in folder.glob("step_*") if p.is_dir())
        for old in steps[:-(LOCAL_KEEP + 1)]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)

    def prune_store(self, keep_last: int, keep_step: int) -> None:
        """Retire the store's checkpoints beyond `keep_last` (rank 0, after a commit; a
        store that does not answer is left as it is: the next commit tries again)."""
        try:
            fence.check("pruning the store's checkpoints")
            steps = self.store.committed_steps()
        except Exception:  # FencedError, StorageError, or the store's own errors
            return
        for step in steps[:-keep_last]:
            if step != keep_step:
                with contextlib.suppress(Exception):  # the next commit tries again
                    self.store.retire(step)
        with contextlib.suppress(Exception):
            self.store.retire_partial(below=keep_step)


class UploadSession:
    """One save's uploads: each shard file is put as soon as its writer closes it
    (`closed`, called on DCP's writer threads), while the other shards are still
    being serialized; `finish` waits for those and puts the rest (the rank file,
    `.metadata`). Every put is retried until the save's deadline.

    Why: the write and the upload one after the other cost their sum; a rank
    writes `SHARD_FILES` files on its writer threads, so all but the last are in
    flight before the write ends (bench/ckpt_io.py, s3_ckpt_throughput).
    """

    def __init__(self, target: RemoteTarget, step: int, deadline: float) -> None:
        self.target, self.step, self.deadline = target, step, deadline
        self._pool = ThreadPoolExecutor(max_workers=TRANSFER_THREADS,
                                        thread_name_prefix="kc-upload")
        self._lock = threading.Lock()
        self._early: dict[str, Future[None]] = {}

    def closed(self, path: Path) -> None:
        """A shard is whole on disk (checksummed, fsynced): start its upload."""
        if path.suffix != ".distcp":
            return
        with self._lock:
            if path.name not in self._early:
                self._early[path.name] = self._pool.submit(self._put, path)

    def _put(self, path: Path) -> None:
        fence.check(f"upload of {path.name}")  # each upload as it starts: a fenced rank sends none
        self.target.store.put(self.step, path.name, path, self.target.on_retry, self.deadline)

    def finish(self, tmp: Path, own_files: dict[str, Any]) -> None:
        """Wait for the early uploads, then put this rank's other files.

        Raises:
            CheckpointError: A file could not be put by the deadline.
        """
        with self._lock:
            early = dict(self._early)
        for future in early.values():
            future.result()
        rest = {name: tmp / name for name in own_files if name not in early}
        fence.check(f"upload of checkpoint step {self.step}")
        self.target.store.upload(self.step, rest, self.target.on_retry, deadline=self.deadline)

    def close(self) -> None:
        """Stop taking uploads; wait for those running (a failed save's end here)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

