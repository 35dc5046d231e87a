"""Turn a sharded checkpoint into one file of model weights, for inference.

No model class is needed: the DCP metadata lists every tensor with its shape
and dtype, so we allocate plain tensors from it and let `dcp.load` fill them
in this one process. The optimizer state and the rank files are left out.

The job's code wrote the folder, and this runs in a trusted process (`kc
checkpoint export`), so it reads through `dcp_reader.FolderReader`: the
metadata unpickled with a restricted unpickler, nothing read from outside the
folder or through a symlink, no pickled item loaded.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from kuangchao.platform.protocol.checkpoint import read_manifest, verify
from kuangchao.workers.checkpoint.dcp_reader import (
    FolderReader,
    TensorsOnly,
    failure_message,
    stored_bytes,
    tensor_bytes,
)
from kuangchao.workers.errors import CheckpointError

FORMATS = ("torch", "safetensors")
MODEL_PREFIX = "model."  # the trainer saves {"model": ..., "optim": ...}; DCP flattens with dots


def read_model_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The model's weights from a checkpoint folder, keyed like `model.state_dict()`.

    Does not verify the folder; `export_model` does.

    Raises:
        CheckpointError: The folder has no DCP metadata, or no model tensors.
    """
    path = Path(path)
    with FolderReader(path) as reader:
        metadata = reader.read_metadata()
        stored = stored_bytes(metadata)
        metas = {fqn: meta for fqn, meta in metadata.state_dict_metadata.items()
                 if fqn.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)}
        if not metas:
            raise CheckpointError(f"{path}: the checkpoint holds no model tensors "
                                  f"(no '{MODEL_PREFIX}*' keys)")
        # What is allocated is bounded by what the shards hold: the metadata is the job's.
        short = next((f for f, m in metas.items() if tensor_bytes(m) > stored.get(f, 0)), None)
        if short is not None:
            raise CheckpointError(f"{path}: {short} is larger in the DCP metadata than in its "
                                  "shards; the checkpoint is corrupt")
        state = {fqn: torch.empty(meta.size, dtype=meta.properties.dtype)
                 for fqn, meta in metas.items()}
        _load(state, reader, path)
    return {fqn[len(MODEL_PREFIX):]: t for fqn, t in state.items()}


def export_model(path: str | Path, out: str | Path, fmt: str, check: bool = True) -> dict[str, Any]:
    """Verify a checkpoint folder and write its model weights to one file.

    Args:
        path: A step folder (`.../step_00000200`).
        out: The file to write; replaced atomically (written next to it, then renamed).
        fmt: "torch" (a `torch.save`d dict) or "safetensors".
        check: Verify the folder first; False when the caller just did.

    Returns:
        {"step", "path", "out", "format", "tensors", "bytes"}.

    Raises:
        CheckpointError: It does not verify, or cannot be read.
        ValueError: Unknown `fmt`.
        OSError: `out` cannot be written.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    manifest = verify(path) if check else read_manifest(path)
    tensors = read_model_tensors(path)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        if fmt == "safetensors":
            from safetensors.torch import save_file

            save_file(tensors, str(tmp), metadata={"format": "pt", "step": str(manifest["step"]),
                                                   "spec_hash": str(manifest.get("spec_hash", ""))})
        else:
            torch.save(tensors, tmp)
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(OSError):  # never mask the real error with a cleanup error
            tmp.unlink(missing_ok=True)
    return {"step": manifest["step"], "path": str(path), "out": str(out), "format": fmt,
            "tensors": len(tensors), "bytes": out.stat().st_size}


def load_model_state(path: str | Path, model: torch.nn.Module) -> dict[str, Any]:
    """Load a checkpoint's weights into `model` in this process alone (no collectives).

    Returns:
        The manifest. Raises `CheckpointError` when it does not verify.
    """
    manifest = verify(path)
    state = {"model": model.state_dict()}
    with FolderReader(path) as reader:
        _load(state, reader, Path(path))
    model.load_state_dict(state["model"])
    return manifest


def _load(state: dict[str, Any], reader: FolderReader, path: Path) -> None:
    """`dcp.load` into `state` in this process alone, tensors only.

    Raises:
        CheckpointError: The checkpoint cannot be read into `state`.
    """
    with warnings.catch_warnings():
        # dcp warns that it assumes a single process; that is exactly the intent here.
        warnings.filterwarnings("ignore", message=".*single process.*")
        try:
            # no_dist: a load into this one process, even where a process group exists.
            dcp.load(state, storage_reader=reader, planner=TensorsOnly(), no_dist=True)
        except CheckpointError:
            raise
        # DCP wraps what failed in a BaseException; a bad shard fails in many ways.
        except (Exception, CheckpointException) as exc:
            raise CheckpointError(f"{path}: cannot load the checkpoint: "
                                  f"{failure_message(exc)}") from None
