"""The on-disk format of one checkpoint folder, how to verify it, and which of a
job's checkpoints verify.

Layout of `{root}/{job_id}/step_{step:08d}/`:

    *.distcp, .metadata    DCP shards of {"model", "optim"}
    rank_{r}.pt            per-rank trainer state (RNG states, data position)
    manifest.json          written last (workers/checkpoint/manager.py writes it)

The ranks write checkpoints (workers/checkpoint/); the controller, the CLI
and the API read them with this module alone, without torch or a process group.
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kuangchao.workers.errors import CheckpointError

MANIFEST = "manifest.json"
# 1: step, spec_hash, world_size, created_at, files (+ the caller's extra keys).
# 2: adds platform_version, torch_version, parallel, data_position, rng.
# 3: adds checksum, the algorithm of the file digests (formats 1 and 2: always sha256).
FORMAT_VERSION = 3
READABLE_FORMATS = (1, 2, 3)
# Manifest keys the manager writes itself; a caller's `extra` may not reuse them.
RESERVED_KEYS = frozenset({"format", "step", "spec_hash", "world_size", "created_at", "files",
                           "platform_version", "torch_version", "rng", "checksum"})
# What the manager writes: CRC-32 runs at several GB/s where SHA-256 manages
# about 1, and the digest only has to catch torn writes, truncation and bit
# rot (the size is checked too), not tampering: whoever can rewrite a shard
# can rewrite the manifest next to it. verify() checks either.
CHECKSUM = "crc32"
CHECKSUMS = ("crc32", "sha256")
_CHUNK = 1 << 20
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint, as `save` / `PendingCheckpoint.result()` return it.

    Attributes:
        step, path, bytes: Which checkpoint, where, and its size on disk.
        blocked_s: Seconds the caller's training loop was held up: waiting for
            the previous save, plus staging (async) or the whole write (sync).
        write_s: Seconds the write itself took (DCP shards, rank files,
            fsync, checksums, manifest and rename).
    """

    step: int
    path: str
    bytes: int
    blocked_s: float = 0.0
    write_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "path": self.path, "bytes": self.bytes,
                "blocked_s": round(self.blocked_s, 6), "write_s": round(self.write_s, 6)}


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path) -> int | None:
    """The step a `step_XXXXXXXX` folder name stands for, else None."""
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


class Checksum:
    """A running digest of one of `CHECKSUMS`: `update(bytes)`, then `hexdigest()`.

    Both hashlib and zlib release the GIL on large buffers, so files written or
    read on several threads are checksummed in parallel.
    """

    def __init__(self, algorithm: str = CHECKSUM) -> None:
        if algorithm not in CHECKSUMS:
            raise ValueError(f"unknown checksum {algorithm!r}; known: {CHECKSUMS}")
        self.algorithm = algorithm
        self._crc = 0
        self._hash = hashlib.sha256() if algorithm == "sha256" else None

    def update(self, data: Any) -> None:
        if self._hash is None:
            self._crc = zlib.crc32(data, self._crc)
        else:
            self._hash.update(data)

    def hexdigest(self) -> str:
        return f"{self._crc:08x}" if self._hash is None else self._hash.hexdigest()


def checksum_file(path: Path, algorithm: str = CHECKSUM) -> str:
    digest = Checksum(algorithm)
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    return checksum_file(path, "sha256")


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder, without checking the files.

    Raises:
        CheckpointError: When it is missing, not JSON, or of an unknown format.
    """
    path = Path(path)
    try:
        raw = (path / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {MANIFEST}; the checkpoint is partial") from None
    except OSError as exc:
        raise CheckpointError(f"{path}/{MANIFEST} cannot be read: {exc}") from None
    return parse_manifest(raw, str(path))


def parse_manifest(raw: bytes | str, where: str) -> dict[str, Any]:
    """A manifest's text checked as `read_manifest` checks one (`where` names its folder)."""
    try:
        manifest = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{where}/{MANIFEST} is corrupt: {exc}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{where}/{MANIFEST} is malformed: no file list")
    fmt = manifest.get("format")
    if fmt not in READABLE_FORMATS:
        raise CheckpointError(f"{where}: checkpoint format {fmt!r} is not one this kuangchao reads "
                              f"{READABLE_FORMATS}; it was written by another version")
    return manifest


def verify(path: str | Path) -> dict[str, Any]:
    """Check a checkpoint folder against its manifest (formats 1 to 3).

    Every listed file must exist with its recorded size and digest, computed
    with the manifest's `checksum` algorithm (sha256 when it names none).

    Returns:
        The manifest.

    Raises:
        CheckpointError: Saying which file is missing, truncated or altered.
    """
    path = Path(path)
    manifest = read_manifest(path)
    algorithm = manifest.get("checksum", "sha256")
    if algorithm not in CHECKSUMS:
        raise CheckpointError(f"{path}/{MANIFEST} names checksum {algorithm!r}, not one this "
                              f"kuangchao knows {CHECKSUMS}")
    for name, meta in manifest["files"].items():
        # The folder and its manifest are written by the job's code: a name
        # must be a file of this folder, and a symlink (to another job's
        # folder, to /etc) is never read through.
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name:
            raise CheckpointError(f"{path}/{MANIFEST} lists {name!r}, which is not a file name "
                                  "of the folder")
        f = path / name
        try:
            expected_bytes, expected_digest = meta["bytes"], meta[algorithm]
        except (KeyError, TypeError):
            raise CheckpointError(f"{path}/{MANIFEST} is malformed: bad entry for {name}") from None
        if f.is_symlink():
            raise CheckpointError(f"{path}: {name} is a symlink; a checkpoint holds plain files")
        if not f.is_file():
            raise CheckpointError(f"{path}: file {name} listed in the manifest is missing")
        size = f.stat().st_size
        if size != expected_bytes:
            raise CheckpointError(
                f"{path}: {name} has {size} bytes, the manifest says {expected_bytes}")
        if checksum_file(f, algorithm) != expected_digest:
            raise CheckpointError(f"{path}: {name} fails its checksum")
    return manifest


def check_extra(extra: dict[str, Any] | None) -> None:
    """Refuse `extra` manifest fields that would overwrite the manager's own."""
    clash = RESERVED_KEYS & set(extra or {})
    if clash:
        raise ValueError(f"extra may not set {sorted(clash)}: the checkpoint manager writes them")


# -- a job's checkpoints ----------------------------------------------------------

def job_dir(root: str | Path, job_id: str) -> Path:
    """The folder holding the step folders of job `job_id` under checkpoint root `root`."""
    return Path(root).expanduser() / job_id


def committed(folder: Path) -> list[Path]:
    """The step folders of one job's folder that have a manifest, oldest first (not verified).

    A save renames its folder into place only after its manifest is written,
    so a folder without one is a write that never finished.
    """
    if not folder.exists():
        return []
    return sorted(p for p in folder.glob("step_*") if (p / MANIFEST).exists())


def verified(folder: Path, hold: Callable[[Path], AbstractContextManager[Any]] | None = None,
             ) -> Iterator[tuple[Path, dict[str, Any]]]:
    """A job's checkpoints whose manifest verifies, newest first, as (path, manifest).

    A checkpoint that fails verification is skipped: restoring falls back to
    the one before it.

    Args:
        hold: Entered around each verification; the checkpoint manager passes
            the guard that keeps its pruning away from the folder being read.
    """
    for path in reversed(committed(folder)):
        try:
            with (hold(path) if hold else nullcontext()):
                manifest = verify(path)
        except CheckpointError:
            continue
        yield path, manifest


def latest_verified(folder: Path, hold: Callable[[Path], AbstractContextManager[Any]] | None = None,
                    ) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint of a job's folder that verifies, or None."""
    return next(verified(folder, hold), None)
