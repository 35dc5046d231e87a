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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from kuangchao.platform.protocol import checkpoint as protocol
from kuangchao.platform.protocol.checkpoint import (
    CheckpointInfo,
    check_extra,
    read_manifest,
    step_dir_name,
)
from kuangchao.platform.storage.urls import is_url
from kuangchao.workers import fence
from kuangchao.workers.checkpoint.async_save import (
    PendingCheckpoint,
    StagingBuffers,
    stage_to_cpu,
)
from kuangchao.workers.checkpoint.export import load_model_state
from kuangchao.workers.checkpoint.files import (
    load_rank_state,
)
from kuangchao.workers.checkpoint.paths import check_roots
from kuangchao.workers.checkpoint.pruning import Pruner
from kuangchao.workers.checkpoint.remote import RemoteTarget, local_dir, remote_for
from kuangchao.workers.checkpoint.state_reader import StateDictReader, read_states, write_states
from kuangchao.workers.checkpoint.writer import SaveJob, write
from kuangchao.workers.errors import CheckpointError

__all__ = ["CheckpointManager", "load_model_state"]


class CheckpointManager:
    """Saves, lists and restores one job's checkpoints. Call on every rank.

    `save`, `save_async` and `wait` are collective: every rank calls them at
    the same point, with the same steps.

    `roots`: the folders jobs may keep checkpoints in on this node
    (`settings.checkpoint_roots()`); the job's folder must resolve, symlinks
    followed, inside one, checked before each save, listing and load. None: no
    check (tools and tests working on their own folders).
    """

    def __init__(self, root: str | Path, job_id: str, rank: int, world_size: int,
                 spec_hash: str, keep_last: int = 3,
                 on_commit: Callable[[CheckpointInfo], None] | None = None,
                 roots: tuple[str, ...] | None = None, local_staging: str | None = None,
                 on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.root, self.roots = root, roots
        # checkpoint.path an object-store URL: the store holds the checkpoints, and
        # self.dir is this node's folder of local copies (remote.py).
        self.remote: RemoteTarget | None = None
        if is_url(str(root)):
            self.remote = RemoteTarget(remote_for(str(root), job_id), staging=bool(local_staging),
                                       on_event=lambda e: self.on_event and self.on_event(e))
            self.dir = local_dir(str(root), job_id, local_staging)
            self._staging_dir = local_staging
        else:
            self.dir = protocol.job_dir(root, job_id)
        self.on_event = on_event  # told of what the job should hear of (upload retries)
        self._verified: set[Path] = set()  # local copies of remote steps fetched and verified
        self._check_roots()
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
        self._pruner = Pruner()

    # -- listing --------------------------------------------------------------

    def _check_roots(self) -> None:
        if self.roots is None:
            return
        if self.remote is None:
            check_roots(self.root, self.dir, self.roots)
        elif self._staging_dir:  # the node cache is the platform's own; staging is the job's
            check_roots(self._staging_dir, self.dir, self.roots)

    @property
    def location(self) -> str:
        """Where the job's checkpoints are kept: its folder, or its URL in the store."""
        return str(self.remote.store.url) if self.remote is not None else str(self.dir)

    def list(self) -> list[Path]:
        """Committed checkpoint folders, oldest first (not yet verified).

        For a URL checkpoint path, the local folders each would be fetched into:
        `verify` or `load` fetches it.
        """
        self._check_roots()
        if self.remote is not None:
            return self.remote.paths(self.dir)
        return protocol.committed(self.dir)

    def verify(self, path: Path) -> dict[str, Any]:
        """The manifest of the checkpoint at `path` (from `list`) if every file verifies.

        For a URL checkpoint path, the step is fetched into `path` first (only
        what this node lacks) and verified there.

        Raises:
            CheckpointError: Saying which file is missing, truncated or altered.
        """
        path = Path(path)
        if self.remote is None:
            return protocol.verify(path)
        with self._reading_from(path):
            manifest = self.remote.fetch(path)
        self._verified.add(path)
        return manifest

    def latest_verified(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint whose manifest verifies, skipping broken ones."""
        self._check_roots()
        if self.remote is not None:
            for path in reversed(self.list()):
                with contextlib.suppress(CheckpointError):
                    return path, self.verify(path)
            return None
        return protocol.latest_verified(self.dir, hold=self._reading_from)

    def wait_pruned(self, timeout: float | None = None) -> bool:
        """Wait until the checkpoints the last commit retired are deleted; False on timeout.

        Only for callers that want the disk space or the CPU back now: retired
        checkpoints are already out of `list()`, and the next commit waits anyway.
        """
        return self._pruner.wait(timeout)

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
        self._check_roots()
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

        The caller may step the optimizer right away: the write (DCP shards,
        fsync, checksums, manifest, rename or upload) works on a private copy,
        on a background thread. Same arguments and collective rules as `save`.

        Memory: the CPU copy is kept and overwritten in place by the next
        `save_async` when the state has the same keys, shapes and dtypes (a
        copy into pages never touched costs several times one into pages in
        use), as torch's own async checkpointing caches its staging buffers:
        from the first call on, this manager holds one host copy of this rank's
        model and optimizer state, dropped after a failed write.

        Time: `get_state_dict` with the previous call's FQN map when nothing
        changed (`StateDictReader`), and one fused copy along the previous
        copy's layout (`StagingBuffers`): mostly the copy itself (~5 ms for
        88 MB on the bench machine).

        Returns:
            A handle; `result()` waits for the commit. A failure of the write
            is raised (as `CheckpointError`) by `result()`, and by this
            manager's next `wait`, `save` or `save_async` call.
        """
        t0 = time.perf_counter()
        check_extra(extra)
        self._check_roots()
        self.wait()
        if self._already_committed(step):
            return PendingCheckpoint.completed(self.last_committed)  # type: ignore[arg-type]
        model_sd, optim_sd = self._read_state(model, optimizer)
        # After wait(): no write reads the previous copy any more, so it may be overwritten.
        staged = self._staging.stage({"model": model_sd, "optim": optim_sd})
        job = self._job(step, staged, stage_to_cpu(rank_state), extra)
        blocked_s = time.perf_counter() - t0
        pending = PendingCheckpoint(step, self._where(step, job.final), blocked_s)

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
        return last is not None and last.step == step and (
            self.remote is not None or Path(last.path).exists())

    def _job(self, step: int, state: dict[str, Any], rank_state: dict[str, Any],
             extra: dict[str, Any] | None) -> SaveJob:
        tmp = (self.remote.tmp_for(self.dir, step, self.rank) if self.remote is not None
               else self.dir / f".{step_dir_name(step)}.tmp")
        return SaveJob(step=step, state=state, rank_state=rank_state, extra=dict(extra or {}),
                       group=self._checkpoint_group(), tmp=tmp,
                       final=self.dir / step_dir_name(step), rank=self.rank,
                       world_size=self.world_size, spec_hash=self.spec_hash, remote=self.remote)

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

    def prepare_group(self) -> None:
        """Make the checkpoint group now, at the top of a generation, before the rank
        reports ready. At the first save, `new_group`'s rendezvous (a wait in the key-value
        store, which a lost peer does not break as it breaks a collective) could wait on
        a rank that died since, and the survivors would hang until the group's timeout."""
        self._checkpoint_group()

    def _checkpoint_group(self) -> dist.ProcessGroup | None:
        """The gloo group checkpoint collectives use; made once per group, by
        `prepare_group` or else at the first save.

        `new_group` is itself a collective on the default group, so it runs in
        the caller's thread, where every rank reaches it at the same point.
        """
        if not self._group_ready:
            if dist.is_available() and dist.is_initialized():
                self._group = dist.new_group(backend="gloo")
            self._group_ready = True
        return self._group

    def _write(self, job: SaveJob) -> tuple[int, float]:
        return write(job, after_rename=self._prune)

    def _committed(self, job: SaveJob, size: int, write_s: float,
                   blocked_s: float) -> CheckpointInfo:
        info = CheckpointInfo(step=job.step, path=self._where(job.step, job.final), bytes=size,
                              blocked_s=blocked_s, write_s=write_s)
        self.last_committed = info
        if self.rank == 0 and self.on_commit is not None:
            self.on_commit(info)
        return info

    def _where(self, step: int, final: Path) -> str:
        return str(self.remote.store.step_url(step)) if self.remote is not None else str(final)

    def _prune(self, keep: Path) -> None:
        """After a commit: retire what is beyond `keep_last` (pruning.py; remote.py for a store)."""
        fence.check("pruning old checkpoints")
        if self.remote is not None:
            self._pruner.wait()
            self._pruner.reaper = self.remote.start_prune(self.keep_last, keep)
        else:
            self._pruner.prune(self.dir, self.list(), self.keep_last, keep)

    def _reading_from(self, path: Path) -> contextlib.AbstractContextManager[None]:
        """Keep the pruning of this manager's commits away from `path` meanwhile."""
        return self._pruner.reading_from(path)

    # -- loading --------------------------------------------------------------

    def load(self, path: Path, model: torch.nn.Module,
             optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Restore model and optimizer; return this rank's saved state.

        A checkpoint `kc checkpoint convert` made from weights (its manifest says
        `converted_from`) holds the model alone: the optimizer starts fresh."""
        t0 = time.perf_counter()
        path = Path(path)
        self._check_roots()
        if self.remote is not None and path not in self._verified:
            self.verify(path)  # fetch it to this node first
        with self._reading_from(path):
            model_sd, optim_sd = read_states(model, optimizer)
            if "converted_from" in read_manifest(path):
                from torch.distributed.checkpoint.state_dict import set_model_state_dict

                state = {"model": model_sd}
                dcp.load(state, checkpoint_id=str(path))
                set_model_state_dict(model, state["model"])
            else:
                state = {"model": model_sd, "optim": optim_sd}
                dcp.load(state, checkpoint_id=str(path))
                write_states(model, optimizer, state["model"], state["optim"])
            rank_file = path / f"rank_{self.rank}.pt"
            if not rank_file.exists():  # world size changed: fall back to rank 0's
                rank_file = path / "rank_0.pt"
            rank_state = load_rank_state(rank_file)
            self.last_restored_step = read_manifest(path).get("step")
        self.last_load_s, self.last_load_end = time.perf_counter() - t0, time.time()
        return rank_state

