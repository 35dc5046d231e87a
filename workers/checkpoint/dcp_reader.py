"""Reading a DCP checkpoint that the job's code may have written, in a trusted process.

DCP's `.metadata` is a pickle, and `FileSystemReader.read_metadata` unpickles it
with the full unpickler: a crafted file runs whatever it names in the process
reading it (`kc checkpoint export` on an operator's machine, say). Its
`storage_data` also names the shard files by relative path, which DCP joins to
the folder as it is (`../../elsewhere`), and its byte items are unpickled in
full as well (`DefaultLoadPlanner.load_bytes`).

`FolderReader` reads the same checkpoints with none of that:

- `.metadata` through `MetadataUnpickler`, which builds only what DCP's
  metadata holds (its metadata dataclasses, `_StorageInfo`, `torch.Size`, the
  torch dtypes, layouts and memory formats, paths, plain containers) and
  refuses any other global with a `CheckpointError`, before anything of it runs;
- then checks the result: every shard a plain file name in the folder, every
  byte range inside its file, no storage transforms;
- opens the folder once (not following a symlink) and every file relative to
  it with O_NOFOLLOW, so nothing is read from outside the folder;
- tensors as DCP reads them, with torch's weights-only unpickler.

`TensorsOnly`, the planner to load with, refuses a pickled (BYTE_IO) item
instead of unpickling it: export and `load_model_state` load tensors only.
"""

from __future__ import annotations

import errno
import math
import os
import pickle
import stat
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PosixPath, PurePosixPath
from typing import IO, Any, BinaryIO

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.serialization import _get_layout

from kuangchao.workers.checkpoint.paths import plain_name
from kuangchao.workers.errors import CheckpointError

METADATA = ".metadata"

# (module, name) -> the object a DCP .metadata pickle may name, as the pickle spells it.
# Found by tracing `find_class` over real saves (tests/unit/test_checkpoint_security.py
# keeps tracing them). Every one is plain data or builds plain data from its arguments.
_GLOBALS: dict[tuple[str, str], Any] = {
    **{("torch.distributed.checkpoint.metadata", n): getattr(dcp_md, n) for n in (
        "Metadata", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "_MEM_FORMAT_ENCODING")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_fs._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _get_layout,  # looks a layout up by name, nothing else
    ("pathlib", "PosixPath"): PosixPath, ("pathlib", "PurePosixPath"): PurePosixPath,
    ("pathlib._local", "PosixPath"): PosixPath, ("pathlib._local", "PurePosixPath"): PurePosixPath,
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set, ("builtins", "frozenset"): frozenset,
}
# `torch.<name>` for these kinds: dtypes (torch.float32), layouts, memory formats.
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler for DCP's `.metadata`: the globals of `_GLOBALS` and torch's
    dtypes, layouts and memory formats, nothing else, and no persistent ids."""

    def __init__(self, file: IO[bytes], where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        found = _GLOBALS.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self.where}: refusing to unpickle {module + '.' + name!r}; DCP metadata holds only its "
            "own metadata classes, torch sizes and dtypes, and plain data, so this file was not "
            "written by DCP (loading it could run code)")

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.where}: refusing a persistent id; DCP metadata has none")


def load_metadata(file: IO[bytes], where: str) -> dcp_md.Metadata:
    """Unpickle a `.metadata` file with `MetadataUnpickler` and check what it built.

    Raises:
        CheckpointError: A global DCP never writes, a corrupt pickle, or a result
            that is not DCP metadata.
    """
    try:
        metadata = MetadataUnpickler(file, where).load()
    except CheckpointError:
        raise
    except Exception as exc:  # a corrupt pickle comes in many exception types
        raise CheckpointError(f"{where}: cannot read the DCP metadata: "
                              f"{type(exc).__name__}: {exc}") from None
    if type(metadata) is not dcp_md.Metadata:
        raise CheckpointError(f"{where}: not DCP metadata (a {type(metadata).__name__})")
    try:
        _check_entries(metadata, where)
    except CheckpointError:
        raise
    except Exception as exc:  # an allowed class built without its fields, say
        raise CheckpointError(f"{where}: malformed DCP metadata: {type(exc).__name__}") from None
    return metadata


def _is_int(x: Any, low: int = 0) -> bool:
    return type(x) is int and x >= low


def _is_size(x: Any) -> bool:
    return type(x) is torch.Size and all(_is_int(d) for d in x)


def _check_entries(metadata: dcp_md.Metadata, where: str) -> None:
    """The tensor entries well formed, every storage entry a plain file name and byte range."""
    entries = metadata.state_dict_metadata
    if type(entries) is not dict or not all(type(k) is str for k in entries):
        raise CheckpointError(f"{where}: malformed DCP metadata: no state dict entries")
    for fqn, meta in entries.items():
        if type(meta) is dcp_md.BytesStorageMetadata:
            continue
        props = getattr(meta, "properties", None)
        chunks = getattr(meta, "chunks", None)
        if (type(meta) is not dcp_md.TensorStorageMetadata or type(props) is not dcp_md.TensorProperties
                or not isinstance(props.dtype, torch.dtype) or not _is_size(meta.size)
                or type(chunks) is not list
                or not all(type(c) is dcp_md.ChunkStorageMetadata and _is_size(c.offsets)
                           and _is_size(c.sizes) for c in chunks)):
            raise CheckpointError(f"{where}: malformed DCP metadata entry {fqn!r}")
    if metadata.storage_meta is not None and type(metadata.storage_meta) is not dcp_md.StorageMeta:
        raise CheckpointError(f"{where}: malformed DCP metadata: storage_meta")
    storage = metadata.storage_data
    if type(storage) is not dict:
        raise CheckpointError(f"{where}: malformed DCP metadata: no storage entries")
    for index, info in storage.items():
        if type(index) is not dcp_md.MetadataIndex or type(index.fqn) is not str:
            raise CheckpointError(f"{where}: malformed DCP storage key {index!r}")
        if type(info) is not dcp_fs._StorageInfo or type(info.relative_path) is not str:
            raise CheckpointError(f"{where}: malformed DCP storage entry for {index.fqn!r}")
        if not plain_name(info.relative_path):
            raise CheckpointError(f"{where}: {index.fqn!r} is stored in {info.relative_path!r}, "
                                  "not a file of the checkpoint folder; refusing to read it")
        if not (_is_int(info.offset) and _is_int(info.length)):
            raise CheckpointError(f"{where}: malformed byte range for {index.fqn!r}")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{where}: {index.fqn!r} is stored through transforms "
                                  f"{info.transform_descriptors!r}, which this reader does not apply")


def stored_bytes(metadata: dcp_md.Metadata) -> dict[str, int]:
    """The bytes stored for each entry: the lengths of its storage ranges, added up."""
    out: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        out[index.fqn] = out.get(index.fqn, 0) + info.length
    return out


def tensor_bytes(meta: dcp_md.TensorStorageMetadata) -> int:
    return math.prod(meta.size) * meta.properties.dtype.itemsize


class Folder:
    """One checkpoint folder, open (not through a symlink); files are opened inside it,
    by plain name, without following a symlink."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
        try:
            self.fd = os.open(os.path.realpath(path), flags | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot open the checkpoint folder: "
                                  f"{exc.strerror or exc}") from None

    def open(self, name: str) -> BinaryIO:
        if not plain_name(name):
            raise CheckpointError(f"{self.path}: {name!r} is not a file of the checkpoint folder")
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(name, flags, dir_fd=self.fd)
        except OSError as exc:
            why = ("a symlink, which no checkpoint holds" if exc.errno == errno.ELOOP
                   else exc.strerror or str(exc))
            raise CheckpointError(f"{self.path}/{name}: cannot be read: {why}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CheckpointError(f"{self.path}/{name} is not a regular file")
        return os.fdopen(fd, "rb")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # -- what FileSystemReader asks of its `fs` -------------------------------------
    def init_path(self, path: str | os.PathLike[str]) -> Path:
        return self.path

    def concat_path(self, path: Any, suffix: str) -> str:
        return suffix  # a name inside this folder; `open` refuses anything else

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[BinaryIO]:
        if mode != "rb":
            raise CheckpointError(f"{self.path}: opened for reading only")
        with self.open(os.fspath(path)) as stream:
            yield stream


class FolderReader(FileSystemReader):
    """`FileSystemReader` for a checkpoint a job wrote: see the module docstring.
    Use as a context manager, or `close()` it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(str(path))
        self.folder = Folder(path)
        self.fs = self.folder  # type: ignore[assignment]  # read_data opens shards through it
        self.path = self.folder.path

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_md.Metadata:
        rank = kwargs.get("rank")
        name = METADATA if rank is None else f"__{int(rank)}{METADATA}"
        where = f"{self.path}/{name}"
        with self.folder.open(name) as fh:
            metadata = load_metadata(fh, where)
        sizes: dict[str, int] = {}
        for index, info in metadata.storage_data.items():
            if info.relative_path not in sizes:
                with self.folder.open(info.relative_path) as f:
                    sizes[info.relative_path] = os.fstat(f.fileno()).st_size
            if info.offset + info.length > sizes[info.relative_path]:
                raise CheckpointError(f"{where}: {index.fqn!r} lies past the end of "
                                      f"{info.relative_path}")
        storage_meta = getattr(metadata, "storage_meta", None) or dcp_md.StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata

    def close(self) -> None:
        self.folder.close()

    def __enter__(self) -> FolderReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class TensorsOnly(DefaultLoadPlanner):
    """DCP's default load planner, except that a pickled item is refused, not unpickled."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise CheckpointError(f"{read_item.dest_index.fqn} is stored pickled; only tensors "
                              "are read from a checkpoint here")


def failure_message(exc: BaseException) -> str:
    """The reason a `dcp.load` failed: the `CheckpointError` DCP wrapped, where it did."""
    for failure in (getattr(exc, "failures", None) or {}).values():
        inner = failure[0] if isinstance(failure, tuple) and failure else failure
        if isinstance(inner, CheckpointError):
            return inner.message
        if isinstance(inner, BaseException):
            return f"{type(inner).__name__}: {inner}"
    return f"{type(exc).__name__}: {exc}"
