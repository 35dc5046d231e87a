"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

Layout of one checkpoint, `{root}/{job_id}/step_{step:08d}/`:

    *.distcp, .metadata    DCP shards of {"model", "optim"}
    rank_{r}.pt            per-rank trainer state (RNG states, data position)
    manifest.json          written last: format, step, platform and torch
                           versions, spec hash, world size, parallel layout,
                           data position, which RNG states the rank files
                           hold, the checksum algorithm, and every file with
                           its size and digest

A checkpoint is written into a hidden temporary folder and renamed into place
only after every rank finished and the manifest is fsynced, so a crash never
leaves a folder that looks complete. Only folders whose manifest verifies are
ever restored. Each file is checksummed as it is written (no second read),
and checkpoints beyond `keep_last` are renamed out of sight at the commit and
deleted on a background thread.

`save` writes while the caller waits. `save_async` only makes a CPU copy of
the state while the caller waits and writes it on a background thread, over a
gloo process group of its own so that its collectives never interleave with
the training loop's on the default group. At most one save is in flight. The
CPU copy is kept and overwritten by the next `save_async`, so a manager that
saved asynchronously holds one host copy of the model and optimizer state.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from kuangchao.platform.version import __version__
from kuangchao.workers.checkpoint.async_save import (
    PendingCheckpoint,
    StagingBuffers,
    stage_to_cpu,
)
from kuangchao.workers.checkpoint.export import load_model_state
from kuangchao.workers.checkpoint.files import (
    ChecksummingWriter,
    ChecksumStream,
    file_entry,
    retire,
    retire_leftovers,
    start_reaper,
)
from kuangchao.workers.checkpoint.format import (
    CHECKSUM,
    FORMAT_VERSION,
    MANIFEST,
    CheckpointInfo,
    check_extra,
    fsync_path,
    read_manifest,
    step_dir_name,
    verify,
)
from kuangchao.workers.checkpoint.state_reader import StateDictReader, read_states, write_states
from kuangchao.workers.errors import CheckpointError

# Threads, and so shard files, per rank for the DCP write, each checksumming
# its own file as it writes. On 2 cores, 2 save ~20% over 1 for an 88 MB state.
WRITER_THREADS = 2

__all__ = ["MANIFEST", "FORMAT_VERSION", "CheckpointInfo", "CheckpointManager", "PendingCheckpoint",
           "load_model_state", "read_manifest", "step_dir_name", "verify"]


@dataclass
class _SaveJob:
    """Everything one write needs, fixed at the time of the save call."""

    step: int
    state: dict[str, Any]  # {"model": ..., "optim": ...}: staged copies, or live for `save`
    rank_state: dict[str, Any]
    extra: dict[str, Any]
    group: dist.ProcessGroup | None
    tmp: Path
    final: Path
    # {name: {bytes, <checksum>: digest}} of the files this rank wrote, for the manifest.
    own_files: dict[str, dict[str, Any]] = field(default_factory=dict)


class CheckpointManager:
    """Saves, lists and restores one job's checkpoints. Call on every rank.

    `save`, `save_async` and `wait` are collective: every rank calls them at
    the same point, with the same steps.
    """

    def __init__(self, root: str | Path, job_id: str, rank: int, world_size: int,
                 spec_hash: str, keep_last: int = 3,
                 on_commit: Callable[[CheckpointInfo], None] | None = None) -> None:
        self.dir = Path(root).expanduser() / job_id
        self.rank, self.world_size = rank, world_size
        self.spec_hash, self.keep_last = spec_hash, keep_last
        # Called on rank 0 once a checkpoint is committed; for save_async on the writer thread.
        self.on_commit = on_commit
        self.last_committed: CheckpointInfo | None = None
        # Set by load(), for the restart record (TrainContext reads them): the
        # step restored, how long the load took, and when it ended (time.time()).
        self.last_restored_step: int | None = None
        self.last_load_s: float | None = None
        self.last_load_end: float | None = None
        self._pending: PendingCheckpoint | None = None
        # The previous save_async's CPU copy of {"model", "optim"}, overwritten
        # by the next one; only ever touched once that write is over.
        self._staging = StagingBuffers()
        # save_async's get_state_dict, minus the setup that repeats itself from save to save.
        self._read_state = StateDictReader()
        self._group: dist.ProcessGroup | None = None
        self._group_ready = False
        # Pruning: the thread deleting retired checkpoints, and the folders
        # being read (verified or loaded), which are never retired.
        self._reaper: threading.Thread | None = None
        self._lock = threading.Lock()
        self._reading: dict[Path, int] = {}

    # -- listing --------------------------------------------------------------

    def list(self) -> list[Path]:
        """Committed checkpoint folders, oldest first (not yet verified)."""
        if not self.dir.exists():
            return []
        return sorted(p for p in self.dir.glob("step_*") if (p / MANIFEST).exists())

    def latest_verified(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint whose manifest verifies, skipping broken ones."""
        for path in reversed(self.list()):
            try:
                with self._reading_from(path):
                    return path, verify(path)
            except CheckpointError:
                continue
        return None

    def wait_pruned(self, timeout: float | None = None) -> bool:
        """Wait until the checkpoints the last commit retired are deleted; False on timeout.

        Only for callers that want the disk space or the CPU back now: retired
        checkpoints are already out of `list()`, and the next commit waits anyway.
        """
        reaper = self._reaper
        if reaper is not None:
            reaper.join(timeout)
            if reaper.is_alive():
                return False
        return True

    # -- saving ---------------------------------------------------------------

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             rank_state: dict[str, Any], extra: dict[str, Any] | None = None) -> CheckpointInfo:
        """Write a checkpoint and return once it is committed; every rank must call it.

        Waits for a pending `save_async` first. Saving a step this manager has
        already committed returns that checkpoint instead of writing it again.

        Args:
            step: Optimizer steps completed.
            model, optimizer: Saved as sharded DCP state. Pass the unwrapped model.
            rank_state: This rank's own state (RNG states under "rng", data position).
            extra: Metadata for the manifest (rank 0's is recorded): the
                built-in trainer passes "parallel" and "data_position".

        Raises:
            CheckpointError: This write failed, or the previous async one did.
        """
        t0 = time.perf_counter()
        check_extra(extra)
        self.wait()
        if self._already_committed(step):
            return self.last_committed  # type: ignore[return-value]
        model_sd, optim_sd = read_states(model, optimizer)
        # The caller is blocked for the whole write, so the live tensors are written directly.
        job = self._job(step, {"model": model_sd, "optim": optim_sd}, rank_state, extra)
        size, write_s = self._write(job)
        return self._committed(job, size, write_s, blocked_s=time.perf_counter() - t0)

    def save_async(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   rank_state: dict[str, Any], extra: dict[str, Any] | None = None,
                   ) -> PendingCheckpoint:
        """Start a checkpoint; return once the state is copied to CPU memory.

        The caller may step the optimizer right away: the write works on a
        private copy. The DCP write, fsync, checksums, manifest and rename run
        on a background thread. Same arguments and collective rules as `save`.

        Memory: the CPU copy of the model and optimizer state is kept after
        the write, and the next `save_async` copies into it in place when the
        state has the same keys, shapes and dtypes (fresh memory for anything
        that changed): a copy into pages never touched costs several times one
        into pages in use. So from the first call on, this manager holds one host
        copy of this rank's model and optimizer state, as torch's own async
        checkpointing does with its cached staging buffers. It is overwritten
        only after the previous write is over (this call waits for it first),
        and dropped after a failed write.

        Time: the state is what `get_state_dict` returns, read with the FQN
        map of the previous call when the model and optimizer are unchanged
        (`StateDictReader`), and copied along the previous copy's layout in one
        fused call when it is the same (`StagingBuffers`). What remains is
        mostly the copy itself (~5 ms for 88 MB on the bench machine).

        Returns:
            A handle; `result()` waits for the commit. A failure of the write
            is raised (as `CheckpointError`) by `result()`, and by this
            manager's next `wait`, `save` or `save_async` call.
        """
        t0 = time.perf_counter()
        check_extra(extra)
        self.wait()
        if self._already_committed(step):
            return PendingCheckpoint.completed(self.last_committed)  # type: ignore[arg-type]
        model_sd, optim_sd = self._read_state(model, optimizer)
        # After wait(): no write reads the previous copy any more, so it may be overwritten.
        staged = self._staging.stage({"model": model_sd, "optim": optim_sd})
        job = self._job(step, staged, stage_to_cpu(rank_state), extra)
        blocked_s = time.perf_counter() - t0
        pending = PendingCheckpoint(step, str(job.final), blocked_s)

        def write() -> CheckpointInfo:
            size, write_s = self._write(job)
            return self._committed(job, size, write_s, blocked_s)

        self._pending = pending
        pending.run(write, name=f"kc-checkpoint-{step}")
        return pending

    def wait(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Wait for the save in flight, if any, and return its checkpoint.

        Raises:
            CheckpointError: The background write failed (raised once; the
                manager is then ready for the next save), or it was still
                running after `timeout` seconds (then it stays pending).
        """
        pending = self._pending
        if pending is None:
            return None
        try:
            info = pending.result(timeout)
        except CheckpointError:
            if pending.done():
                self._pending = None
                # A write that failed may have left DCP writer threads behind
                # (torch joins them only when its own part succeeds) that still
                # read the staged copy: the next save copies into fresh memory.
                self._staging.drop()
            raise
        self._pending = None
        return info

    @property
    def pending(self) -> PendingCheckpoint | None:
        """The save in flight (or finished but not yet waited for), if any."""
        return self._pending

    # -- the write, shared by save and save_async -----------------------------

    def _already_committed(self, step: int) -> bool:
        # The step names the state, so a second save of it (periodic and preemption
        # checkpoints at one step) would write the same bytes again.
        last = self.last_committed
        return last is not None and last.step == step and Path(last.path).exists()

    def _job(self, step: int, state: dict[str, Any], rank_state: dict[str, Any],
             extra: dict[str, Any] | None) -> _SaveJob:
        return _SaveJob(step=step, state=state, rank_state=rank_state, extra=dict(extra or {}),
                        group=self._checkpoint_group(), tmp=self.dir / f".{step_dir_name(step)}.tmp",
                        final=self.dir / step_dir_name(step))

    def settle(self, grace_s: float) -> None:
        """Before the process group changes: end the write in flight, or drop it after `grace_s`."""
        try:
            self.wait(timeout=grace_s)
        except CheckpointError:
            pass
        self._pending = None

    def regroup(self, rank: int, world_size: int) -> None:
        """Write as `rank` of `world_size` from now on, in the new process group."""
        self.rank, self.world_size = rank, world_size
        self._group, self._group_ready = None, False

    def _checkpoint_group(self) -> dist.ProcessGroup | None:
        """The gloo group checkpoint collectives use; made once, at the first save.

        `new_group` is itself a collective on the default group, so it runs in
        the caller's thread, where every rank reaches it at the same point.
        """
        if not self._group_ready:
            if dist.is_available() and dist.is_initialized():
                self._group = dist.new_group(backend="gloo")
            self._group_ready = True
        return self._group

    def _write(self, job: _SaveJob) -> tuple[int, float]:
        """Write, agree, commit. Returns (bytes on disk, seconds). Runs on every rank."""
        t0 = time.perf_counter()
        self._phase(job, "preparing the folder", self._prepare_tmp)
        self._phase(job, "writing shards", self._write_shards)
        sizes: list[int] = []
        self._phase(job, "committing", lambda j: sizes.append(self._commit(j)))
        return sum(sizes), time.perf_counter() - t0

    def _phase(self, job: _SaveJob, what: str, fn: Callable[[_SaveJob], Any]) -> None:
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
            raise CheckpointError(f"checkpoint step {job.step}: rank {self.rank} failed while "
                                  f"{what}: {type(error).__name__}: {error}") from error
        if not ok:
            raise CheckpointError(f"checkpoint step {job.step}: another rank failed while {what}; "
                                  "its log has the reason")

    def _prepare_tmp(self, job: _SaveJob) -> None:
        if self.rank != 0:
            return
        shutil.rmtree(job.tmp, ignore_errors=True)
        job.tmp.mkdir(parents=True)

    def _write_shards(self, job: _SaveJob) -> None:
        """Write this rank's DCP shards and rank file, fsync them, and checksum them.

        Every writer fsyncs its own files (DCP does so for its shards and its
        .metadata), since on a shared filesystem no other node can. Each rank
        checksums what it writes, as the bytes go out on its writer threads,
        so the hashing is spread over ranks and threads and nothing is read back.
        """
        writer = ChecksummingWriter(job.tmp, thread_count=WRITER_THREADS)
        dcp.save(job.state, storage_writer=writer, process_group=job.group, no_dist=job.group is None)
        rank_file = job.tmp / f"rank_{self.rank}.pt"
        with rank_file.open("wb") as fh:
            out = ChecksumStream(fh)
            torch.save(job.rank_state, cast(IO[bytes], out))
            out.flush()
            os.fsync(fh.fileno())
        written = {**writer.fs.written, rank_file.name: out.entry()}
        # DCP names this rank's shards "__{rank}_{n}.distcp"; rank 0's coordinator writes .metadata.
        own = [rank_file, *job.tmp.glob(f"__{self.rank}_*")]
        if self.rank == 0:
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

    def _commit(self, job: _SaveJob) -> int:
        """Gather the checksums; rank 0 writes the manifest last, renames into place, prunes.

        Returns the bytes committed (0 on the other ranks).
        """
        if job.group is not None:
            gathered: list[Any] = [None] * dist.get_world_size(job.group)
            dist.all_gather_object(gathered, job.own_files, group=job.group)
        else:
            gathered = [job.own_files]
        if self.rank != 0:
            return 0
        files = {name: entry for part in gathered for name, entry in part.items()}
        for f in job.tmp.iterdir():  # anything no rank claimed (another DCP naming) is hashed here
            if f.name not in files:
                files[f.name] = file_entry(f)
        files = dict(sorted(files.items()))
        with (job.tmp / MANIFEST).open("w") as fh:
            json.dump(self._manifest(job, files), fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        if job.final.exists():  # a rerun of the same step (after a restart) replaces the old copy
            retire(job.final)
        os.replace(job.tmp, job.final)
        fsync_path(self.dir)
        self._prune(job.final)
        return sum(m["bytes"] for m in files.values())

    def _manifest(self, job: _SaveJob, files: dict[str, Any]) -> dict[str, Any]:
        extra = dict(job.extra)
        rng = job.rank_state.get("rng")
        return {
            "format": FORMAT_VERSION, "step": job.step, "created_at": time.time(),
            "platform_version": __version__, "torch_version": torch.__version__,
            "spec_hash": self.spec_hash, "world_size": self.world_size,
            "parallel": extra.pop("parallel", None),
            "data_position": extra.pop("data_position", None),
            # The states themselves stay in the rank files; this says what to expect there.
            "rng": {"kinds": list(rng) if isinstance(rng, dict) else [],
                    "rank_files": [f"rank_{r}.pt" for r in range(self.world_size)]},
            "checksum": CHECKSUM,
            **extra,
            "files": files,
        }

    def _committed(self, job: _SaveJob, size: int, write_s: float,
                   blocked_s: float) -> CheckpointInfo:
        info = CheckpointInfo(step=job.step, path=str(job.final), bytes=size,
                              blocked_s=blocked_s, write_s=write_s)
        self.last_committed = info
        if self.rank == 0 and self.on_commit is not None:
            self.on_commit(info)
        return info

    def _prune(self, keep: Path) -> None:
        """Retire the checkpoints beyond `keep_last`, and stale temporary folders.

        Each is renamed at once to a hidden name never used again, so that no
        listing shows it and no save writes into it; a background thread then
        deletes those names only, so the next save's commit never races with
        it. `keep` (just committed: the newest verified checkpoint) and
        checkpoints being verified or loaded are never retired.
        """
        self.wait_pruned()  # the previous deletion; long done in any real training loop
        self._reaper = None
        with self._lock:
            reading = set(self._reading)
            old = [p for p in self.list()[:-self.keep_last] if p != keep and p.resolve() not in reading]
            for path in old:
                with contextlib.suppress(OSError):  # gone already: nothing to do
                    retire(path)
        # Only one save is ever in flight, and it has just been renamed, so no
        # temporary folder left is live.
        doomed = retire_leftovers(self.dir)
        if doomed:
            self._reaper = start_reaper(doomed)

    @contextlib.contextmanager
    def _reading_from(self, path: Path) -> Iterator[None]:
        """Keep the pruning of this manager's commits away from `path` meanwhile."""
        key = Path(path).resolve()
        with self._lock:
            self._reading[key] = self._reading.get(key, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._reading[key] -= 1
                if not self._reading[key]:
                    del self._reading[key]

    # -- loading --------------------------------------------------------------

    def load(self, path: Path, model: torch.nn.Module,
             optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Restore model and optimizer; return this rank's saved state."""
        t0 = time.perf_counter()
        path = Path(path)
        with self._reading_from(path):
            model_sd, optim_sd = read_states(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=str(path))
            write_states(model, optimizer, state["model"], state["optim"])
            rank_file = path / f"rank_{self.rank}.pt"
            if not rank_file.exists():  # world size changed: fall back to rank 0's
                rank_file = path / "rank_0.pt"
            rank_state = torch.load(rank_file, weights_only=False)
            self.last_restored_step = read_manifest(path).get("step")
        self.last_load_s, self.last_load_end = time.perf_counter() - t0, time.time()
        return rank_state

