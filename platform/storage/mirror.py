"""One job's checkpoints in an object store, and the node-local copies through
which the POSIX checkpoint code writes and reads them.

Layout under `{checkpoint.path}/{job_id}/` (the same names as on disk):

    step_XXXXXXXX/*.distcp, .metadata, rank_N.pt     uploaded by the rank that wrote each
    step_XXXXXXXX/manifest.json                      uploaded last, by rank 0

An object store has no rename, so the commit is the manifest: it is uploaded
only after every rank's files are in, and a step without one is invisible
(`committed_steps` lists manifests only). Retiring deletes the manifest first,
so a half-deleted checkpoint is never listed either.

Reading never trusts the store: `fetch` copies a step into a local folder
(only what is missing or of the wrong size), then verifies every file against
the manifest with its checksum, as on disk. A truncated or altered object is
fetched once more, then the checkpoint is refused and the caller falls back to
an older one.

Every request runs with short timeouts (objects.py), and uploads are retried
with backoff until a deadline: a store that stops answering for a while (a
frozen server, a partition) costs the save in flight its deadline at most, and
each retry is told to `on_retry`.

No torch here: the controller, the API and `kc` read checkpoints through it too.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kuangchao.platform.errors import StorageError
from kuangchao.platform.protocol.checkpoint import MANIFEST, parse_manifest, step_dir_name, verify
from kuangchao.platform.storage.objects import describe_failure, short
from kuangchao.platform.storage.urls import ObjectUrl, check_part, parse
from kuangchao.workers.errors import CheckpointError

# An upload (one file) is retried until this long after the save began writing
# to the store; then the save fails, the next one starts afresh, and training
# goes on. Longer than a store's usual hiccup, shorter than a checkpoint interval.
UPLOAD_DEADLINE_S = 120.0
RETRY_BACKOFF_S = (1.0, 2.0, 4.0, 8.0)
TRANSFER_THREADS = 4
_STEP_PREFIX = "step_"

# on_retry(attempt, what, error): told of each failed try before the next one.
RetryHook = Callable[[int, str, str], None]


class RemoteCheckpoints:
    """The store side of one job's checkpoints: `{url}` is `{checkpoint.path}/{job_id}`."""

    def __init__(self, url: str | ObjectUrl, fs: Any = None) -> None:
        """`fs`: the filesystem to use; None: this process's (access.py), asked at each
        use, so that a rank's renewed credentials take effect at once."""
        self.url = parse(url) if isinstance(url, str) else url
        self._fs = fs

    @property
    def fs(self) -> Any:
        if self._fs is not None:
            return self._fs
        from kuangchao.platform.storage.access import open_filesystem

        return open_filesystem(self.url.scheme)

    def __str__(self) -> str:
        return str(self.url)

    def step_url(self, step: int) -> ObjectUrl:
        return self.url.join(step_dir_name(step))

    def _object(self, step: int, name: str) -> str:
        check_part(name)
        return self.step_url(step).join(name).path

    # -- listing ---------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        """Steps whose manifest is in the store, oldest first (not verified).

        Raises:
            StorageError: The store cannot be listed (unreachable, refused).
        """
        try:
            found = self.fs.glob(f"{self.url.path}/{_STEP_PREFIX}*/{MANIFEST}")
        except FileNotFoundError:
            return []
        except Exception as exc:  # the store's own errors vary by scheme
            raise StorageError(describe_failure(exc, self.url)) from None
        steps = []
        for key in found:
            name = key.rstrip("/").split("/")[-2]
            if name.startswith(_STEP_PREFIX) and name[len(_STEP_PREFIX):].isdigit():
                steps.append(int(name[len(_STEP_PREFIX):]))
        return sorted(set(steps))

    def manifest(self, step: int) -> dict[str, Any]:
        """The store's manifest of `step`, checked as `read_manifest` checks one on disk."""
        try:
            raw = self.fs.cat_file(self._object(step, MANIFEST))
        except FileNotFoundError:
            raise CheckpointError(f"{self.step_url(step)}: no {MANIFEST}; the checkpoint is "
                                  "partial") from None
        except Exception as exc:
            raise CheckpointError(f"{self.step_url(step)}/{MANIFEST} cannot be read: "
                                  f"{describe_failure(exc, self.url)}") from None
        return parse_manifest(raw, str(self.step_url(step)))

    def sizes(self, step: int) -> dict[str, int]:
        """The size of every object of `step`, by file name (one listing, no download)."""
        try:
            listing = self.fs.ls(self.step_url(step).path, detail=True)
        except FileNotFoundError:
            return {}
        except Exception as exc:
            raise StorageError(describe_failure(exc, self.url)) from None
        return {e["name"].rstrip("/").split("/")[-1]: int(e.get("size") or 0)
                for e in listing if e.get("type") != "directory"}

    def shallow_verify(self, step: int) -> dict[str, Any]:
        """The manifest of `step` if every file it lists is in the store at its size.

        Catches what a crash or a lost upload leaves (missing or truncated
        objects) without downloading; the checksums are checked by `fetch`.
        """
        manifest = self.manifest(step)
        have = self.sizes(step)
        for name, meta in manifest["files"].items():
            check_name(name, self.step_url(step))
            if name not in have:
                raise CheckpointError(f"{self.step_url(step)}: file {name} listed in the manifest "
                                      "is missing from the store")
            if have[name] != meta.get("bytes"):
                raise CheckpointError(f"{self.step_url(step)}: {name} has {have[name]} bytes in the "
                                      f"store, the manifest says {meta.get('bytes')}")
        return manifest

    def latest(self, skipped: Callable[[int, str], None] | None = None,
               ) -> tuple[int, dict[str, Any]] | None:
        """The newest step whose objects are all there at their sizes, or None."""
        for step in reversed(self.committed_steps()):
            try:
                return step, self.shallow_verify(step)
            except CheckpointError as exc:
                if skipped is not None:
                    skipped(step, exc.message)
        return None

    # -- reading ---------------------------------------------------------------

    def fetch(self, step: int, local: Path, reuse: bool = True) -> dict[str, Any]:
        """Make `local` a verified copy of `step`; return its manifest.

        Files already in `local` at the manifest's size are kept (a rank's own
        shards, a staged copy) and checked with everything else; one that fails
        its checksum is fetched again, once. The manifest is written last, so
        `local` looks like a checkpoint only once it is whole. Ranks on one node
        fetch one at a time into one folder (a lock beside it).

        Raises:
            CheckpointError: The step is incomplete or corrupt in the store, or
                cannot be read from it.
        """
        local.parent.mkdir(parents=True, exist_ok=True)
        with _locked(local.parent / f".{local.name}.lock"):
            manifest = self.manifest(step)
            files = manifest["files"]
            for name in files:
                check_name(name, self.step_url(step))
            local.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError, CheckpointError):
                if not reuse:
                    raise FileNotFoundError
                if json.loads((local / MANIFEST).read_text()) == manifest:
                    verify(local)  # a copy made earlier, still whole (else fetched again)
                    return manifest
            (local / MANIFEST).unlink(missing_ok=True)
            for attempt in (1, 2):
                stale = [n for n, m in files.items() if not _has_size(local / n, m.get("bytes"))]
                self._download(step, stale, local)
                _write_atomic(local / MANIFEST, json.dumps(manifest, indent=1).encode())
                try:
                    verify(local)
                    return manifest
                except CheckpointError as exc:
                    (local / MANIFEST).unlink(missing_ok=True)
                    if attempt == 2:
                        raise CheckpointError(f"{self.step_url(step)}: {exc.message}") from None
                    # Files kept at the right size may still hold other bytes (an older
                    # save of this step on this node, bit rot): all fetched again, once.
                    for name in files:
                        (local / name).unlink(missing_ok=True)
        raise AssertionError("unreachable")

    def _download(self, step: int, names: list[str], local: Path) -> None:
        def get(name: str) -> None:
            tmp = local / f".{name}.part"
            try:
                self.fs.get_file(self._object(step, name), str(tmp))
            except FileNotFoundError:
                raise CheckpointError(f"{self.step_url(step)}: file {name} listed in the "
                                      "manifest is missing from the store") from None
            except CheckpointError:
                raise
            except Exception as exc:
                raise CheckpointError(f"{self.step_url(step)}/{name} cannot be read: "
                                      f"{describe_failure(exc, self.url)}") from None
            os.replace(tmp, local / name)

        if names:
            with ThreadPoolExecutor(max_workers=min(TRANSFER_THREADS, len(names))) as pool:
                list(pool.map(get, names))

    # -- writing ---------------------------------------------------------------

    def upload(self, step: int, files: dict[str, Path], on_retry: RetryHook | None = None,
               deadline: float | None = None) -> None:
        """Put each local file as `step/<name>`, in parallel, each retried until `deadline`
        (`time.monotonic()`; default `UPLOAD_DEADLINE_S` from now).

        Raises:
            CheckpointError: A file could not be put by the deadline.
        """
        deadline = deadline if deadline is not None else time.monotonic() + UPLOAD_DEADLINE_S
        if files:
            with ThreadPoolExecutor(max_workers=min(TRANSFER_THREADS, len(files))) as pool:
                list(pool.map(lambda item: self.put(step, item[0], item[1], on_retry, deadline),
                              sorted(files.items())))

    def put(self, step: int, name: str, path: Path, on_retry: RetryHook | None,
            deadline: float) -> None:
        """Put one local file as `step/<name>`, retried until `deadline` (monotonic)."""
        retrying(lambda: self.fs.put_file(str(path), self._object(step, name)),
                 f"upload of {name} (step {step})", deadline, on_retry)

    def commit(self, step: int, manifest: dict[str, Any], on_retry: RetryHook | None = None,
               deadline: float | None = None) -> None:
        """Upload the manifest of `step`: the checkpoint exists from now on."""
        body = json.dumps(manifest, indent=1).encode()
        deadline = deadline if deadline is not None else time.monotonic() + UPLOAD_DEADLINE_S
        retrying(lambda: self.fs.pipe_file(self._object(step, MANIFEST), body),
                 f"manifest of step {step}", deadline, on_retry)

    def retire(self, step: int) -> None:
        """Hide `step` (its manifest goes first), then delete the rest. Gone already is fine."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._object(step, MANIFEST))
        self._delete_all(self.step_url(step).path)

    def _delete_all(self, prefix: str) -> None:
        """Every object under `prefix`, one request each: a bulk delete (S3's
        DeleteObjects) reports no per-key refusal through s3fs, and some stores
        authorise it against the bucket, which a job's scoped keys do not reach."""
        try:
            keys = self.fs.find(prefix)
        except FileNotFoundError:
            return
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(key)

    def retire_partial(self, below: int) -> None:
        """Delete the step prefixes below step `below` that have no manifest: saves that
        died before their commit. Never at or above it: the next save may be uploading
        there while this runs (steps only grow while a job trains)."""
        done = set(self.committed_steps())
        try:
            names = self.fs.ls(self.url.path, detail=False)
        except FileNotFoundError:
            return
        for key in names:
            name = key.rstrip("/").split("/")[-1]
            digits = name[len(_STEP_PREFIX):]
            if name.startswith(_STEP_PREFIX) and digits.isdigit():
                step = int(digits)
                if step < below and step not in done:
                    self._delete_all(self.step_url(step).path)


def job_checkpoints(root: str, job_id: str) -> RemoteCheckpoints:
    """The store side of `job_id`'s checkpoints under the URL `root`, opened with this
    process's credentials (access.py: a rank's job's, else the operator's)."""
    return RemoteCheckpoints(parse(root).join(job_id))


def verify_step_url(step_url: str) -> dict[str, Any]:
    """The manifest of the checkpoint at `step_url` (`…/{job_id}/step_X`) if every file it
    lists is in the store at its size (`shallow_verify`; the ranks checksummed each
    file as they wrote it, and check every checksum again when they restore).

    Raises:
        CheckpointError: Not a step URL, or incomplete in the store.
    """
    from kuangchao.platform.protocol.checkpoint import step_of

    url = parse(step_url)
    parent, _, name = url.key.rpartition("/")
    step = step_of(Path(name))
    if step is None or not parent:
        raise CheckpointError(f"{step_url} is not a checkpoint step (…/<job>/step_XXXXXXXX)")
    from kuangchao.platform.storage.access import open_filesystem

    store = RemoteCheckpoints(ObjectUrl(url.scheme, url.bucket, parent), open_filesystem(url.scheme))
    return store.shallow_verify(step)


def retrying(fn: Callable[[], Any], what: str, deadline: float,
             on_retry: RetryHook | None = None) -> Any:
    """`fn()`, tried again with backoff on any failure until `deadline` (monotonic)."""
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as exc:  # a store's failures come in many types; all are retried
            error = short(f"{type(exc).__name__}: {exc}")
            wait = RETRY_BACKOFF_S[min(attempt - 1, len(RETRY_BACKOFF_S) - 1)]
            if time.monotonic() + wait >= deadline:
                raise CheckpointError(f"{what} failed after {attempt} tries: {error}") from None
            if on_retry is not None:
                on_retry(attempt, what, error)
            time.sleep(wait)


def check_name(name: Any, where: ObjectUrl) -> None:
    """A manifest entry must be a plain file name of its step (as `verify` requires on disk)."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name:
        raise CheckpointError(f"{where}/{MANIFEST} lists {name!r}, which is not a file of the "
                              "checkpoint")


def _has_size(path: Path, size: Any) -> bool:
    try:
        return path.is_file() and not path.is_symlink() and path.stat().st_size == size
    except OSError:
        return False


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.part")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)

