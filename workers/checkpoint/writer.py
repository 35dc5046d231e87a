"""How one checkpoint is written, on every rank: the folder, the shards and rank
files, the agreement after each phase, the manifest, and the rename into place.

Split from manager.py, which decides what is saved and when (sync or async, one
save in flight, pruning); this module only carries out one `SaveJob`. Both
`save` and `save_async` end up in `write`, on the caller's or a background thread.

Every file a rank writes, and the commit, asks the rank's lease first
(workers/fence.py): a rank replaced while cut off writes no shard and commits
nothing; one whose lease has lapsed waits until it knows which it is.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from kuangchao.platform.protocol.checkpoint import CHECKSUM, FORMAT_VERSION, MANIFEST
from kuangchao.platform.version import __version__
from kuangchao.workers import fence
from kuangchao.workers.checkpoint.files import (
    ChecksummingWriter,
    ChecksumStream,
    file_entry,
    fsync_path,
    retire,
)
from kuangchao.workers.errors import CheckpointError

if TYPE_CHECKING:
    from kuangchao.workers.checkpoint.remote import RemoteTarget, UploadSession

# Threads, and so shard files, per rank for the DCP write, each checksumming
# its own file as it writes. On 2 cores, 2 save ~20% over 1 for an 88 MB state.
WRITER_THREADS = 2
# Shard files per rank for an object-store save: written two at a time, so that
# each is uploaded while the later ones are still being written (8: the upload
# starts while the later ones are still being written, not after all of them).
SHARD_FILES = 8


@dataclass
class SaveJob:
    """Everything one write needs, fixed at the time of the save call."""

    step: int
    state: dict[str, Any]  # {"model": ..., "optim": ...}: staged copies, or live for `save`
    rank_state: dict[str, Any]
    extra: dict[str, Any]
    group: dist.ProcessGroup | None
    tmp: Path
    final: Path
    rank: int
    world_size: int
    spec_hash: str
    # {name: {bytes, <checksum>: digest}} of the files this rank wrote, for the manifest.
    own_files: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Set when checkpoint.path is an object-store URL: `tmp` is then this rank's own
    # folder on its node, and the commit is the manifest's upload (remote.py).
    remote: RemoteTarget | None = None
    uploads: UploadSession | None = None  # this save's uploads, begun as shards close


def write(job: SaveJob, after_rename: Callable[[Path], None]) -> tuple[int, float]:
    """Write, agree, commit. Returns (bytes on disk, seconds). Runs on every rank.

    Args:
        after_rename: Called on rank 0 with the committed folder, once it is in
            place (the manager prunes older checkpoints there).
    """
    t0, started = time.perf_counter(), time.monotonic()
    if job.remote is not None:
        uploads = job.uploads = job.remote.session(job.step, started)
        try:
            _phase(job, "preparing the folder", _prepare_tmp)
            _phase(job, "writing shards", _write_shards)
            _phase(job, "uploading", lambda j: uploads.finish(j.tmp, j.own_files))
            sizes_r: list[int] = []
            _phase(job, "committing",
                   lambda j: sizes_r.append(_commit_remote(j, after_rename, started)))
        finally:
            uploads.close()
            job.uploads = None
        return sum(sizes_r), time.perf_counter() - t0
    _phase(job, "preparing the folder", _prepare_tmp)
    _phase(job, "writing shards", _write_shards)
    sizes: list[int] = []
    _phase(job, "committing", lambda j: sizes.append(_commit(j, after_rename)))
    return sum(sizes), time.perf_counter() - t0


def _phase(job: SaveJob, what: str, fn: Callable[[SaveJob], Any]) -> None:
    """Run `fn(job)` on this rank, then agree with the others that all succeeded.

    The agreement doubles as the barrier between phases, and makes every
    rank raise when any failed, instead of leaving the others waiting at
    the next barrier until the group's timeout.
    """
    error: BaseException | None = None
    try:
        fn(job)
    except Exception as exc:
        error = exc
    ok = error is None
    if job.group is not None:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=job.group)
        ok = bool(flag.item())
    if error is not None:
        raise CheckpointError(f"checkpoint step {job.step}: rank {job.rank} failed while "
                              f"{what}: {type(error).__name__}: {error}") from error
    if not ok:
        raise CheckpointError(f"checkpoint step {job.step}: another rank failed while {what}; "
                              "its log has the reason")


def _prepare_tmp(job: SaveJob) -> None:
    fence.check(f"checkpoint step {job.step}")
    if job.remote is not None:  # every rank writes a folder of its own
        job.remote.prepare(job.tmp)
        return
    if job.rank != 0:
        return
    shutil.rmtree(job.tmp, ignore_errors=True)
    job.tmp.mkdir(parents=True)


def _write_shards(job: SaveJob) -> None:
    """Write this rank's DCP shards and rank file, fsync them, and checksum them.

    Every writer fsyncs its own files (DCP does so for its shards and its
    .metadata), since on a shared filesystem no other node can. Each rank
    checksums what it writes, as the bytes go out on its writer threads,
    so the hashing is spread over ranks and threads and nothing is read back.
    """
    uploads = job.uploads  # to an object store: more files than threads, each shipped once closed
    writer = ChecksummingWriter(job.tmp, thread_count=WRITER_THREADS,
                                files=SHARD_FILES if uploads is not None else None,
                                on_closed=uploads.closed if uploads is not None else None)
    dcp.save(job.state, storage_writer=writer, process_group=job.group, no_dist=job.group is None)
    rank_file = job.tmp / f"rank_{job.rank}.pt"
    fence.check(f"checkpoint file {rank_file.name}")
    with rank_file.open("wb") as fh:
        out = ChecksumStream(fh)
        torch.save(job.rank_state, cast(IO[bytes], out))
        out.flush()
        os.fsync(fh.fileno())
    written = {**writer.fs.written, rank_file.name: out.entry()}
    # DCP names this rank's shards "__{rank}_{n}.distcp"; rank 0's coordinator writes .metadata.
    own = [rank_file, *job.tmp.glob(f"__{job.rank}_*")]
    if job.rank == 0:
        own.append(job.tmp / ".metadata")
    entries: dict[str, dict[str, Any]] = {}
    unseen: list[Path] = []
    for f in own:
        if not f.is_file():
            continue
        entry = written.get(f.name)
        if entry is not None and entry["bytes"] == f.stat().st_size:
            entries[f.name] = entry
        else:  # not written through the checksumming stream (another DCP version): read it back
            unseen.append(f)
    if unseen:
        # hashlib and zlib release the GIL on large buffers, so the files hash in parallel.
        with ThreadPoolExecutor(max_workers=max(1, min(len(unseen), WRITER_THREADS))) as pool:
            entries.update(zip((f.name for f in unseen), pool.map(file_entry, unseen), strict=True))
    job.own_files = entries


def _commit(job: SaveJob, after_rename: Callable[[Path], None]) -> int:
    """Gather the checksums; rank 0 writes the manifest last, renames into place, prunes.

    Returns the bytes committed (0 on the other ranks).
    """
    if job.group is not None:
        gathered: list[Any] = [None] * dist.get_world_size(job.group)
        dist.all_gather_object(gathered, job.own_files, group=job.group)
    else:
        gathered = [job.own_files]
    if job.rank != 0:
        return 0
    files = {name: entry for part in gathered for name, entry in part.items()}
    for f in job.tmp.iterdir():  # anything no rank claimed (another DCP naming) is hashed here
        if f.name not in files:
            files[f.name] = file_entry(f)
    files = dict(sorted(files.items()))
    fence.check(f"the manifest of checkpoint step {job.step}")  # the commit
    with (job.tmp / MANIFEST).open("w") as fh:
        json.dump(build_manifest(job, files), fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    if job.final.exists():  # a rerun of the same step (after a restart) replaces the old copy
        retire(job.final)
    os.replace(job.tmp, job.final)
    fsync_path(job.final.parent)
    after_rename(job.final)
    return sum(m["bytes"] for m in files.values())


def _commit_remote(job: SaveJob, after_rename: Callable[[Path], None], started: float) -> int:
    """Gather the checksums; rank 0 uploads the manifest (the commit) and prunes; every
    rank then keeps or drops its local files. Returns the bytes committed (0 off rank 0)."""
    assert job.remote is not None
    if job.group is not None:
        gathered: list[Any] = [None] * dist.get_world_size(job.group)
        dist.all_gather_object(gathered, job.own_files, group=job.group)
    else:
        gathered = [job.own_files]
    files = dict(sorted({n: e for part in gathered for n, e in part.items()}.items()))
    if job.rank == 0:
        fence.check(f"the manifest of checkpoint step {job.step}")  # the commit
        job.remote.commit(job.step, build_manifest(job, files), started)
    job.remote.settle_local(job.tmp, job.final)
    if job.rank != 0:
        return 0
    after_rename(job.final)
    return sum(m["bytes"] for m in files.values())


def build_manifest(job: SaveJob, files: dict[str, Any]) -> dict[str, Any]:
    """The manifest of `job` (format `FORMAT_VERSION`), listing `files` with their digests."""
    extra = dict(job.extra)
    rng = job.rank_state.get("rng")
    return {
        "format": FORMAT_VERSION, "step": job.step, "created_at": time.time(),
        "platform_version": __version__, "torch_version": torch.__version__,
        "spec_hash": job.spec_hash, "world_size": job.world_size,
        "parallel": extra.pop("parallel", None),
        "data_position": extra.pop("data_position", None),
        # The states themselves stay in the rank files; this says what to expect there.
        "rng": {"kinds": list(rng) if isinstance(rng, dict) else [],
                "rank_files": [f"rank_{r}.pt" for r in range(job.world_size)]},
        "checksum": CHECKSUM,
        **extra,
        "files": files,
    }
