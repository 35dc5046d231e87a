"""The file layer under checkpoint writes: checksums computed while the bytes
are written, early writeback, torch's own zip CRC turned off for our writer
threads, and retiring old checkpoints off the critical path.

Split from manager.py, which decides what is written and when.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import io
import os
import pickle
import queue
import shutil
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, cast

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from kuangchao.platform.protocol.checkpoint import CHECKSUM, Checksum, checksum_file
from kuangchao.workers import fence
from kuangchao.workers.errors import CheckpointError

# Each shard's writer asks the kernel to start writing back every this many
# bytes, so that the disk works while the rest is serialized and the final
# fsync has little left to wait for (~10% of an 88 MB save on 2 cores).
WRITEBACK_BYTES = 8 << 20

def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder's entry list: renames, new files)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_entry(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, CHECKSUM: checksum_file(path, CHECKSUM)}


# -- writing and checksumming in one pass ---------------------------------------

class ChecksumStream(io.IOBase):
    """A write-only stream over an open binary file that checksums what goes through it.

    With `writeback_bytes`, it also starts the kernel's writeback of each such
    stretch once written (no waiting: the fsync at the end still makes it durable).
    """

    def __init__(self, raw: BinaryIO, writeback_bytes: int = 0) -> None:
        super().__init__()
        self._raw = raw
        self._digest = Checksum(CHECKSUM)
        self.bytes = 0
        self._writeback_every = writeback_bytes if sync_file_range_fn() is not None else 0
        self._writeback_from = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = self._raw.write(data)  # a blocking buffered file writes all of it
        self._digest.update(data)
        self.bytes += n
        if self._writeback_every and self.bytes - self._writeback_from >= self._writeback_every:
            start_writeback(self._raw.fileno(), self._writeback_from)
            self._writeback_from = self.bytes
        return n

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        if not self._raw.closed:
            self._raw.flush()

    def fileno(self) -> int:  # DCP fsyncs through it
        return self._raw.fileno()

    def close(self) -> None:
        if not self.closed:
            super().close()  # flushes
            self._raw.close()

    def entry(self) -> dict[str, Any]:
        """The manifest entry of the bytes written so far."""
        return {"bytes": self.bytes, CHECKSUM: self._digest.hexdigest()}


class ChecksummingFileSystem(FileSystem):
    """DCP's local filesystem, checksumming every file it writes while writing it.

    `written` maps the name of each file written whole to its manifest entry.
    """

    def __init__(self, on_closed: Callable[[Path], None] | None = None) -> None:
        super().__init__()
        self.written: dict[str, dict[str, Any]] = {}
        # Told of each file once it is written whole (an object-store save uploads it then).
        self.on_closed = on_closed

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "r" not in mode:  # a fenced rank opens no checkpoint file for writing
            fence.check(f"checkpoint file {Path(path).name}")
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        with path.open("wb") as raw, without_zip_crc():
            stream = ChecksumStream(raw, WRITEBACK_BYTES)
            yield stream
        self.written[path.name] = stream.entry()
        if self.on_closed is not None:
            self.on_closed(path)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # .metadata is written as .metadata.tmp first
        entry = self.written.pop(Path(path).name, None)
        if entry is not None:
            self.written[Path(new_path).name] = entry


class ChecksummingWriter(FileSystemWriter):
    """`FileSystemWriter` whose files are checksummed on the way out: see `fs.written`.

    `files`: how many shard files to write (default: one per writer thread). More
    files than threads makes them finish one after another, so that `on_closed`
    can start shipping each while the rest are still written. Uses DCP's own
    splitting and writing helpers; where a torch lacks them, one per thread.
    """

    def __init__(self, path: str | os.PathLike, files: int | None = None,
                 on_closed: Callable[[Path], None] | None = None, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs: ChecksummingFileSystem = ChecksummingFileSystem(on_closed)
        self.files = files

    def write_data(self, plan: Any, planner: Any) -> Any:
        from torch.distributed.checkpoint import filesystem as dcp_fs

        split = getattr(dcp_fs, "_split_by_size_and_type", None)
        if (not self.files or split is None or not hasattr(self, "_write_data")
                or not self.single_file_per_rank):
            return super().write_data(plan, planner)
        prefix = plan.storage_data.prefix
        files: queue.Queue = queue.Queue()
        for n, bucket in enumerate(b for b in split(self.files, plan.items) if b):
            name = f"{prefix}{n}{dcp_fs.DEFAULT_SUFFIX}"
            files.put((self.fs.concat_path(self.path, name), name, bucket))
        return self._write_data(planner, files)


@contextlib.contextmanager
def without_zip_crc() -> Iterator[None]:
    """Skip torch.save's per-record zip CRC-32 in this thread, where torch allows that.

    torch.save computes a CRC-32 of every record it writes: for big tensors most
    of its CPU time (~30 of ~37 ms for the 88 MB bench state). torch.load never
    checks it, and the shards are checksummed whole on the way out, so DCP's
    writer threads skip it. Only where torch keeps its config overrides per
    thread, so that no other thread's torch.save changes; elsewhere it stays.
    """
    if zip_crc_is_per_thread():
        from torch.utils.serialization import config
        with cast(Any, config).patch({"save.compute_crc32": False}):
            yield
    else:
        yield


_probe_lock = threading.Lock()


@functools.cache
def zip_crc_is_per_thread() -> bool:
    """Whether turning torch.save's zip CRC off in one thread leaves the others alone."""
    try:
        from torch.serialization import get_crc32_options
        from torch.utils.serialization import config
        seen: list[bool] = []
        # Serialized: where the switch is global, two overlapping probes could leave it off.
        with _probe_lock, cast(Any, config).patch({"save.compute_crc32": False}):
            if get_crc32_options():
                return False
            probe = threading.Thread(target=lambda: seen.append(get_crc32_options()))
            probe.start()
            probe.join()
        return seen == [True]
    except Exception:  # an older torch: no such config
        return False


_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start writeback of the dirty pages, do not wait


@functools.cache
def sync_file_range_fn() -> Callable[..., int] | None:
    """libc's sync_file_range (Linux; Python has no binding), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def start_writeback(fd: int, offset: int) -> None:
    """Start writing back the dirty pages of `fd` from `offset` on; failures are harmless."""
    fn = sync_file_range_fn()
    if fn is not None:
        fn(fd, offset, 0, _SYNC_FILE_RANGE_WRITE)  # ctypes drops the GIL meanwhile


# -- pruning ---------------------------------------------------------------------

TRASH = ".trash"


def retire(path: Path) -> Path:
    """Rename a folder to a hidden name that is used once, `.{name}.{random}.trash`."""
    trash = path.with_name(f".{path.name.lstrip('.')}.{uuid.uuid4().hex[:12]}{TRASH}")
    os.replace(path, trash)
    return trash


def start_reaper(paths: list[Path]) -> threading.Thread:
    """Delete retired folders on a daemon thread; what an exit cuts short, the next commit redoes."""
    def reap() -> None:
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)

    reaper = threading.Thread(target=reap, name="kc-checkpoint-prune", daemon=True)
    reaper.start()
    return reaper


def retire_leftovers(folder: Path) -> list[Path]:
    """Retire the temporary folders of writes that died with their process; return
    every retired folder there, including what a process that died mid-deletion left."""
    for stale in folder.glob(".step_*.tmp"):
        with contextlib.suppress(OSError):
            retire(stale)
    return list(folder.glob(f".step_*{TRASH}"))


def _plain_numpy() -> list[Any]:
    """What a rank's saved RNG state needs beyond tensors and plain data: NumPy's
    array rebuild (`np.random.get_state()` holds one uint32 array)."""
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_rank_state(path: Path) -> dict[str, Any]:
    """A rank's `rank_N.pt`, unpickled with torch's weights-only loader.

    The file is written by the job's own code, and the controller and `kc`
    read checkpoints too: a full unpickle would run whatever a crafted file
    names. Only tensors, plain data and NumPy arrays are rebuilt.

    Raises:
        CheckpointError: For a file that holds anything else, or none that loads.
    """
    try:
        return load_plain(path)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as exc:
        # torch's own message would suggest loading it unsafely; this one does not.
        raise CheckpointError(f"{path}: not a rank state this platform reads "
                              f"({type(exc).__name__}); a rank state holds only tensors, "
                              "numbers, text and NumPy arrays, so this one was not written by "
                              "kuangchao's checkpoint manager, or is damaged") from None


def load_plain(source: Any) -> Any:
    """`torch.load` of `source` (a path or a binary file object) with the weights-only
    loader and NumPy's arrays allowed: what a rank state or a peer-memory copy holds."""
    with torch.serialization.safe_globals(_plain_numpy()):
        return torch.load(source, weights_only=True)
