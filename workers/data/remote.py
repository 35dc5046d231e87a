"""A `data.path` in an object store (`s3://bucket/prefix`, any fsspec URL), copied to
this node before the readers (corpus.py, readers.py) see it.

``local_copy(url)`` mirrors the object, every object under the prefix, or every
object a glob (`s3://b/d/*.jsonl`, `**` too) matches, into
``{node cache}/data/<hash of the URL>/data/``, keeping their names relative to the
prefix, and returns what the readers expect: the file, the folder, or the folder
joined with the same pattern. The tokenized cache then goes inside that copy
(`.kc-tokenized/`), and a second job on the node reuses both.

- **Only what changed**: ``index.json`` beside the copy records each object's size
  and ETag (or modification time); an object whose entry matches, with its local
  file still that size, is not downloaded again. A local file whose object is gone
  is removed, so the readers never see stale data.
- **Atomic per file**: each download goes to a hidden temporary file, renamed
  into place once complete; a reader sees the old file or the new one.
- **One downloader per node**: an ``fcntl.flock`` on the copy's folder; the other
  ranks wait, then find nothing left to fetch (or only what changed meanwhile).
- **The rank's own rights**: the store is listed on every call with this process's
  credentials (storage/access.py), so a copy made for one job is never handed to a
  job whose credentials cannot read the URL; the data_loader token is asked with
  the URL first.

Hidden objects (a segment starting with ``.``) are not copied: the readers skip
them, and the copy keeps its own hidden files (the tokenized cache) there.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import hashlib
import json
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kuangchao.platform.errors import StorageError
from kuangchao.platform.security.admission import split_url_glob
from kuangchao.platform.storage import access, objects, urls
from kuangchao.workers.data.corpus import permit_read
from kuangchao.workers.errors import DataError

DOWNLOAD_THREADS = 4
INDEX = "index.json"
FILES = "data"
PART = ".kc-part-"
# What tells one version of an object from another, by store: S3's ETag, GCS's md5,
# else a modification time.
_TAGS = ("ETag", "etag", "md5Hash", "LastModified", "last_modified", "updated", "mtime", "modified",
         "created")


@dataclass(frozen=True)
class Remote:
    """One object to copy: its fsspec path, size and version tag."""

    path: str
    size: int
    tag: str | None

    @property
    def entry(self) -> list:
        return [self.size, self.tag]


def local_copy(url: str) -> Path:
    """The local copy of `url` (an object, a prefix, or a glob after the bucket), brought
    up to date: see the module doc.

    Raises:
        DataError: The URL names nothing, its bucket does not exist, the store refuses
            the credentials or cannot be reached, or the copy cannot be written; the
            message names data.path and what to change.
        PermissionError: In a rank whose data_loader token does not grant dataset_read.
    """
    permit_read(url)
    try:
        base_url, pattern = split_url_glob(url)
        base = urls.parse(base_url)
    except ValueError as exc:
        raise DataError(f"data.path: {exc}") from None
    folder = cache_folder(base, pattern)
    try:
        fs = access.open_filesystem(base.scheme)
    except StorageError as exc:
        raise DataError(f"data.path: {exc.message}") from None
    wanted, single = _listing(fs, base, pattern, url)  # before the folder: a bad URL leaves none
    with _locked(folder):
        sync(fs, folder, wanted, base, url)
    files = folder / FILES
    return files / pattern if pattern else files / single if single else files


def cache_folder(base: urls.ObjectUrl, pattern: str | None) -> Path:
    """This node's folder for the copy of `base` (+ `pattern`): one per URL."""
    name = str(base) + (f"/{pattern}" if pattern else "")
    return access.cache_dir("data") / hashlib.sha256(name.encode()).hexdigest()[:24]


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        handle = open(folder / ".lock", "a")
    except OSError as exc:
        raise DataError(f"data.path: cannot write the local copy in {folder}: {exc}; make "
                        "KC_NODE_DIR (or KC_HOME) a writable folder with room for the data") from None
    with handle:
        try:
            import fcntl

            fcntl.flock(handle, fcntl.LOCK_EX)
        except (ImportError, OSError):  # no locks here (another OS, some network file systems)
            pass
        yield


# --- listing ---------------------------------------------------------------------------


def _listing(fs: Any, base: urls.ObjectUrl, pattern: str | None,
             url: str) -> tuple[dict[str, Remote], str | None]:
    """({name relative to `base`: object}, the file name when `url` is one object)."""
    try:
        if pattern is None:
            info = fs.info(base.path)
            if base.key and info.get("type") == "file":
                name = base.key.rsplit("/", 1)[-1]
                return {name: _remote(base.path, info)}, name
        found = fs.find(base.path, detail=True)
    except FileNotFoundError as exc:
        raise DataError(_missing(fs, base, url, exc)) from None
    except Exception as exc:  # botocore, aiohttp and fsspec raise many kinds
        raise DataError(f"data.path: cannot list {url}: {objects.describe_failure(exc, base)}") from None
    wanted: dict[str, Remote] = {}
    for path, info in sorted(found.items()):
        if info.get("type", "file") != "file" or not path.startswith(base.path + "/"):
            continue
        rel = path[len(base.path) + 1:]
        if rel.endswith("/"):  # a folder marker some tools write
            continue
        parts = rel.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise DataError(f"data.path: the object {base.scheme}://{path} has an empty, '.' or "
                            "'..' segment in its key and cannot be copied to a folder; rename it, "
                            "or narrow data.path to leave it out")
        if _selected(parts, pattern.split("/") if pattern else None):
            wanted[rel] = _remote(path, info)
    if not wanted:
        what = f"matches no objects under {base}" if pattern else "holds no objects"
        raise DataError(f"data.path: {url} {what} (hidden names skipped); upload the data "
                        "there, or fix data.path")
    return wanted, None


def _remote(path: str, info: dict) -> Remote:
    tag = next((str(info[k]) for k in _TAGS if info.get(k) not in (None, "")), None)
    return Remote(path, int(info.get("size") or 0), tag)


def _selected(parts: list[str], pattern: list[str] | None) -> bool:
    """Whether the object at `parts` is read: none hidden, or, with a glob, some leading
    parts match it (a file, or a folder the readers walk) and the rest are not hidden."""
    if pattern is None:
        return not any(p.startswith(".") for p in parts)
    for k in range(len(parts), 0, -1):
        if any(p.startswith(".") for p in parts[k:]):
            break
        if _glob_match(parts[:k], pattern):
            return True
    return False


def _glob_match(parts: list[str], pattern: list[str]) -> bool:
    """Python's `glob(recursive=True)` rule: `*` stays in a segment, `**` spans any
    number of them, and a wildcard matches no hidden name."""
    if not pattern:
        return not parts
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_glob_match(parts[i:], rest) for i in range(len(parts) + 1)
                   if not any(p.startswith(".") for p in parts[:i]))
    if not parts:
        return False
    name = parts[0]
    if name.startswith(".") and not head.startswith("."):
        return False
    return fnmatch.fnmatchcase(name, head) and _glob_match(parts[1:], rest)


def _missing(fs: Any, base: urls.ObjectUrl, url: str, exc: BaseException) -> str:
    bucket = urls.ObjectUrl(base.scheme, base.bucket)
    if base.key:
        try:
            fs.ls(base.bucket, detail=False)
        except Exception as inner:  # the bucket is the problem: say which
            return f"data.path: cannot read {url}: {objects.describe_failure(inner, bucket)}"
        return (f"data.path: {url} does not exist: no object or prefix of that name in bucket "
                f"{base.bucket!r}; upload the data there, or fix data.path")
    return f"data.path: cannot read {url}: {objects.describe_failure(exc, bucket)}"


# --- copying ---------------------------------------------------------------------------


def read_index(folder: Path) -> dict:
    """The copy's index: {"url", "objects": {name: [size, tag]}, "last_sync": {...}}."""
    try:
        doc = json.loads((folder / INDEX).read_text())
        return doc if isinstance(doc, dict) and isinstance(doc.get("objects"), dict) else {}
    except (OSError, ValueError):
        return {}


def sync(fs: Any, folder: Path, wanted: dict[str, Remote], base: urls.ObjectUrl,
         url: str) -> dict[str, list[str]]:
    """Make `folder/data` hold exactly `wanted` (hidden files aside): download what is new
    or changed, remove what is gone. Returns {"downloaded": [...], "removed": [...]}."""
    files = folder / FILES
    known = read_index(folder).get("objects", {})
    removed = _remove_stale(files, wanted)
    entries = {rel: entry for rel, entry in known.items() if rel in wanted}
    todo = [rel for rel, obj in sorted(wanted.items())
            if entries.get(rel) != obj.entry or not _present(files / rel, obj.size)]
    failures: list[tuple[str, BaseException]] = []
    lock = threading.Lock()

    def fetch(rel: str) -> None:
        obj = wanted[rel]
        try:
            size = _download(fs, obj.path, files / rel)
        except Exception as exc:  # reported together below, after the index is written
            with lock:
                failures.append((rel, exc))
                entries.pop(rel, None)
            return
        with lock:  # a size other than listed: it changed meanwhile; fetch again next time
            entries[rel] = obj.entry if size == obj.size else [size, None]

    try:
        with ThreadPoolExecutor(DOWNLOAD_THREADS, thread_name_prefix="kc-data-copy") as pool:
            list(pool.map(fetch, todo))
    finally:
        done = sorted(r for r in todo if r not in {f for f, _ in failures})
        last = {"downloaded": done, "removed": removed}
        _write_json(folder / INDEX, {"url": url, "objects": entries, "last_sync": last})
    if failures:
        rel, exc = failures[0]
        if _local_failure(exc, files):
            raise DataError(f"data.path: cannot write the local copy of {url} in {files}: {exc}; "
                            "free space there, or set KC_NODE_DIR to a folder with room") from None
        target = urls.ObjectUrl(base.scheme, *wanted[rel].path.split("/", 1))
        more = f" (and {len(failures) - 1} more objects)" if len(failures) > 1 else ""
        raise DataError(f"data.path: cannot download {target}{more}: "
                        f"{objects.describe_failure(exc, target)}") from None
    return last


def _local_failure(exc: BaseException, files: Path) -> bool:
    """Whether a download failed on this node's side (a full or read-only disk, a file in
    the way) rather than the store's."""
    if not isinstance(exc, OSError):
        return False
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EISDIR, errno.ENOTDIR,
                     errno.EEXIST):
        return True
    return bool(exc.filename) and str(exc.filename).startswith(str(files))


def _present(file: Path, size: int) -> bool:
    try:
        return file.is_file() and file.stat().st_size == size
    except OSError:
        return False


def _download(fs: Any, remote: str, dest: Path) -> int:
    """`remote` to `dest` through a temporary file beside it; its size."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}{PART}{os.getpid()}-{threading.get_ident()}")
    try:
        fs.get_file(remote, str(tmp))
        size = tmp.stat().st_size
        os.replace(tmp, dest)
        return size
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _remove_stale(files: Path, wanted: dict[str, Remote]) -> list[str]:
    """Delete the copy's files (hidden ones kept, left-over parts too) whose object is
    gone, and the folders that leaves empty."""
    removed: list[str] = []
    if not files.is_dir():
        return removed
    for dirpath, _dirs, filenames in os.walk(files, topdown=False):
        here = Path(dirpath)
        rel_dir = here.relative_to(files)
        if any(p.startswith(".") for p in rel_dir.parts):
            continue
        for name in filenames:
            rel = (rel_dir / name).as_posix()
            if PART in name or (not name.startswith(".") and rel not in wanted):
                with contextlib.suppress(OSError):
                    (here / name).unlink()
                    if PART not in name:
                        removed.append(rel)
        if here != files:
            with contextlib.suppress(OSError):
                here.rmdir()  # only when empty
    return sorted(removed)


def _write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(f".{path.name}{PART}{os.getpid()}")
    try:
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:  # only an optimisation: the next call downloads again
        with contextlib.suppress(OSError):
            tmp.unlink()
