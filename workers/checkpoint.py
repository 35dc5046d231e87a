"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

Layout of one checkpoint, `{root}/{job_id}/step_{step:08d}/`:

    *.distcp, .metadata    DCP shards of {"model", "optim"}
    rank_{r}.pt            per-rank trainer state (RNG states, data position)
    manifest.json          written last: step, spec hash, world size, files
                           with sizes and SHA-256 checksums

A checkpoint is written into a hidden temporary folder and renamed into place
only after every rank finished and the manifest is fsynced, so a crash never
leaves a folder that looks complete. Only folders whose manifest verifies are
ever restored.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from kuangchao.workers.errors import CheckpointError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "path": self.path, "bytes": self.bytes}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def verify(path: str | Path) -> dict[str, Any]:
    """Check a checkpoint folder against its manifest.

    Returns:
        The manifest.

    Raises:
        CheckpointError: Saying which file is missing, truncated or altered.
    """
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {MANIFEST}; the checkpoint is partial") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}/{MANIFEST} is corrupt: {exc}") from None
    for name, meta in manifest.get("files", {}).items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"{path}: file {name} listed in the manifest is missing")
        if f.stat().st_size != meta["bytes"]:
            raise CheckpointError(
                f"{path}: {name} has {f.stat().st_size} bytes, the manifest says {meta['bytes']}")
        if _sha256(f) != meta["sha256"]:
            raise CheckpointError(f"{path}: {name} fails its checksum")
    return manifest


class CheckpointManager:
    """Saves, lists and restores one job's checkpoints. Call on every rank."""

    def __init__(self, root: str | Path, job_id: str, rank: int, world_size: int,
                 spec_hash: str, keep_last: int = 3,
                 on_commit: Callable[[CheckpointInfo], None] | None = None) -> None:
        self.dir = Path(root).expanduser() / job_id
        self.rank, self.world_size = rank, world_size
        self.spec_hash, self.keep_last = spec_hash, keep_last
        self.on_commit = on_commit  # called on rank 0 once a checkpoint is committed

    def list(self) -> list[Path]:
        """Committed checkpoint folders, oldest first (not yet verified)."""
        if not self.dir.exists():
            return []
        return sorted(p for p in self.dir.glob("step_*") if (p / MANIFEST).exists())

    def latest_verified(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint whose manifest verifies, skipping broken ones."""
        for path in reversed(self.list()):
            try:
                return path, verify(path)
            except CheckpointError:
                continue
        return None

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             rank_state: dict[str, Any], extra: dict[str, Any] | None = None) -> CheckpointInfo:
        """Write a checkpoint collectively; every rank must call it.

        Args:
            step: Optimizer steps completed.
            model, optimizer: Saved as sharded DCP state.
            rank_state: This rank's own state (RNG, data position).
            extra: Metadata recorded in the manifest by rank 0.
        """
        final = self.dir / step_dir_name(step)
        tmp = self.dir / f".{step_dir_name(step)}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        torch.save(rank_state, tmp / f"rank_{self.rank}.pt")
        _barrier()
        size = 0
        if self.rank == 0:
            size = self._commit(tmp, final, step, extra or {})
        _barrier()
        info = CheckpointInfo(step=step, path=str(final), bytes=size)
        if self.rank == 0 and self.on_commit is not None:
            self.on_commit(info)
        return info

    def _commit(self, tmp: Path, final: Path, step: int, extra: dict[str, Any]) -> int:
        files = {}
        for f in sorted(tmp.iterdir()):
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
            files[f.name] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
        manifest = {"format": FORMAT_VERSION, "step": step, "spec_hash": self.spec_hash,
                    "world_size": self.world_size, "created_at": time.time(),
                    "files": files, **extra}
        with (tmp / MANIFEST).open("w") as fh:
            json.dump(manifest, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        if final.exists():  # a rerun of the same step replaces the old copy
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.dir)
        self._prune()
        return sum(m["bytes"] for m in files.values())

    def _prune(self) -> None:
        for old in self.list()[:-self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, model: torch.nn.Module,
             optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Restore model and optimizer; return this rank's saved state."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        rank_file = path / f"rank_{self.rank}.pt"
        if not rank_file.exists():  # world size changed: fall back to rank 0's
            rank_file = path / "rank_0.pt"
        return torch.load(rank_file, weights_only=False)


def load_model_state(path: str | Path, model: torch.nn.Module) -> dict[str, Any]:
    """Load a checkpoint's weights into `model` in a plain process (no group).

    Returns:
        The manifest. Raises `CheckpointError` when it does not verify.
    """
    manifest = verify(path)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(path))
    model.load_state_dict(state["model"])
    return manifest
