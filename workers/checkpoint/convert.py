"""`kc checkpoint convert` and `export --format hf`: a checkpoint, a Hugging Face folder
and one weights file, each into the others where that makes sense (`DIRECTIONS`).

Names: a checkpoint holds kuangchao's (the wrapper's `tok_emb`, `blocks.N`, `norm`,
`lm_head`, or a built-in model's own), and so does a file exported from one; a
Hugging Face folder, and a file made from one, hold the HF names. A file going
into a folder or a checkpoint may hold any of these namings (told from the names)
and is checked against the `--config` architecture (hf_export.match_layout)
before anything is written; a file to the other file format keeps its names.

A checkpoint made here is `step_00000000` of a job folder, model weights only (no
optimizer or RNG state), with a manifest `kc checkpoint verify` accepts and a
"model" entry `{"kind": "hf", "config", "folder", "tokenizer"}`. Every output is
written beside its place and renamed into it. A checkpoint is read as export.py
reads it (FolderReader); the caller verifies it first.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kuangchao.platform.protocol.checkpoint import (
    read_manifest,
    step_dir_name,
    step_of,
    verify,
)
from kuangchao.workers.checkpoint import hf_export
from kuangchao.workers.checkpoint.export import export_model, read_model_tensors
from kuangchao.workers.checkpoint.paths import plain_name
from kuangchao.workers.errors import CheckpointError
from kuangchao.workers.models import hf_names

CHECKPOINT, HF, SAFETENSORS, TORCH = "checkpoint", "hf", "safetensors", "torch"
TARGETS = (HF, SAFETENSORS, TORCH, CHECKPOINT)
FILES = (SAFETENSORS, TORCH)
DIRECTIONS: dict[str, tuple[str, ...]] = {
    CHECKPOINT: (HF, SAFETENSORS, TORCH),
    HF: (CHECKPOINT, SAFETENSORS, TORCH),
    SAFETENSORS: (HF, CHECKPOINT, TORCH),
    TORCH: (HF, CHECKPOINT, SAFETENSORS),
}
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
SOURCE_NAMES = {CHECKPOINT: "a checkpoint", HF: "a Hugging Face folder",
                SAFETENSORS: "a safetensors file", TORCH: "a torch file"}


class Notes(list[str]):
    """The warnings of one conversion: kept for the result, and passed on as they come."""

    def __init__(self, warn: Callable[[str], None] | None) -> None:
        super().__init__()
        self.warn = warn

    def __call__(self, message: str) -> None:
        self.append(message)
        if self.warn is not None:
            self.warn(message)


def directions() -> str:
    """The conversions there are, for messages."""
    return ("checkpoint -> hf, safetensors or torch; Hugging Face folder -> checkpoint, "
            "safetensors or torch; safetensors or torch file -> hf or checkpoint (with --config), "
            "or the other file format")


# -- reading ----------------------------------------------------------------------

def read_hf_folder(folder: Path) -> dict[str, torch.Tensor]:
    """The weights of a Hugging Face folder, under its own names: model.safetensors (or its
    index and shards), else pytorch_model.bin (or its index), read weights-only.

    Raises:
        CheckpointError: No weights, an index naming a file outside the folder, a bad file.
    """
    for index_name, single, kind in ((hf_export.WEIGHTS_INDEX, hf_export.WEIGHTS, SAFETENSORS),
                                     ("pytorch_model.bin.index.json", "pytorch_model.bin", TORCH)):
        index = folder / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(f"{index} is not a weights index: {exc}") from None
            bad = next((f for f in files if not isinstance(f, str) or not plain_name(f)), None)
            if bad is not None:
                raise CheckpointError(f"{index} names {bad!r}, not a file of the folder")
            tensors: dict[str, torch.Tensor] = {}
            for f in files:
                tensors.update(read_weights_file(folder / f, kind))
            return tensors
        if (folder / single).is_file():
            return read_weights_file(folder / single, kind)
    raise CheckpointError(f"{folder} holds no weights ({hf_export.WEIGHTS}, "
                          f"{hf_export.WEIGHTS_INDEX} or pytorch_model.bin)")


def read_weights_file(path: Path, kind: str) -> dict[str, torch.Tensor]:
    """A flat {name: tensor} file: safetensors, or a torch file read weights-only.

    Raises:
        CheckpointError: Not readable as that, or not a flat dict of tensors.
    """
    try:
        if kind == SAFETENSORS:
            from safetensors.torch import load_file

            return load_file(str(path))
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except Exception as exc:  # a corrupt or foreign file fails in many ways
        raise CheckpointError(f"{path} cannot be read as a {kind} file: "
                              f"{type(exc).__name__}: {str(exc)[:300]}") from None
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a flat dict of "
                              "named tensors (a state_dict)")
    return dict(state)


# -- writing ----------------------------------------------------------------------

def write_weights_file(tensors: dict[str, torch.Tensor], out: Path, fmt: str,
                       metadata: dict[str, str]) -> int:
    """Write one safetensors or torch file atomically; returns its size."""
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        if fmt == SAFETENSORS:
            hf_export.save_safetensors(tensors, tmp, metadata)
        else:
            torch.save(tensors, tmp)
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return out.stat().st_size


def checkpoint_folder(out: Path) -> Path:
    """The step folder a checkpoint goes to: `out` if it is named `step_00000000`, else
    `out/step_00000000` (`out` being a job's checkpoint folder).

    Raises:
        CheckpointError: It exists already, `out` is named for another step, or
            cannot be made.
    """
    step = step_of(out)
    if step not in (None, 0):
        raise CheckpointError(f"--out {out}: a converted checkpoint is step 0; name the job's "
                              f"checkpoint folder or a {step_dir_name(0)} folder")
    final = out if step == 0 else out / step_dir_name(0)
    parent = final.parent
    if final.exists() or final.is_symlink():
        raise CheckpointError(f"--out {final} exists; a job's first checkpoint is written once: "
                              "choose a new folder (or remove it)")
    if parent.exists() and not parent.is_dir():
        raise CheckpointError(f"--out {out}: {parent} is not a folder; choose another --out")
    if not parent.exists() and not parent.parent.is_dir():
        raise CheckpointError(f"--out {out}: folder {parent.parent} does not exist; create it "
                              "or choose another --out")
    check = parent if parent.exists() else parent.parent
    if not os.access(check, os.W_OK | os.X_OK):
        raise CheckpointError(f"--out {out}: folder {check} is not writable; choose another --out")
    return final


def write_checkpoint(tensors: dict[str, torch.Tensor], final: Path, model: dict[str, Any],
                     source: dict[str, Any]) -> dict[str, Any]:
    """Write `tensors` (kuangchao names) as checkpoint step 0 at `final`, model only.

    The manifest is the manager's (workers/checkpoint/writer.py): files with
    their checksums, world size 1, data position at the start, and `model`.

    Returns:
        {"step": 0, "out", "tensors", "bytes"}.
    """
    from kuangchao.workers.checkpoint.writer import SaveJob, write

    created = not final.parent.exists()
    final.parent.mkdir(exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in tensors.items()}
    extra = {"model": model, "parallel": None,
             "data_position": {"step": 0, "next_batch": 0, "skipped_batches": []},
             "converted_from": source}
    job = SaveJob(step=0, state={"model": state},
                  rank_state={"step": 0, "skipped_batches": [], "grad_norms": []},
                  extra=extra, group=None, tmp=final.parent / f".{final.name}.tmp",
                  final=final, rank=0, world_size=1, spec_hash="")
    try:
        with warnings.catch_warnings():
            # dcp warns that it assumes a single process; that is exactly the intent here.
            warnings.filterwarnings("ignore", message=".*single process.*")
            size, _ = write(job, after_rename=lambda _path: None)
    except BaseException:
        shutil.rmtree(job.tmp, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                final.parent.rmdir()
        raise
    return {"step": 0, "out": str(final), "tensors": len(state), "bytes": size}


# -- checkpoint -> Hugging Face folder ----------------------------------------------

def checkpoint_hf_tensors(path: Path, entry: dict[str, Any] | None, config_override: dict[str, Any] | None,
                          warn: Callable[[str], None]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A checkpoint's model tensors under HF names, checked, and the config.json they fit."""
    where = str(path)
    tensors = read_model_tensors(path)
    if config_override is not None:
        config = config_override
        naming = hf_names.naming_of(tensors) or hf_names.KC
    else:
        config, naming = hf_export.hf_source(entry, where)
    try:
        renamed = hf_names.to_hf_names(tensors, naming)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    hf = {renamed[k]: v for k, v in tensors.items()}
    layout = hf_export.expected_layout(config)
    if not layout.checked:
        warn(f"{where}: {layout.note}")
    return hf_export.match_layout(hf, layout, where, warn), config


def export_hf(path: str | Path, out: str | Path, *, tokenizer: str | Path | None = None,
              config: str | Path | None = None, check: bool = True,
              max_shard_bytes: int = hf_export.DEFAULT_MAX_SHARD_BYTES,
              warn: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Verify a checkpoint folder and write its model as a Hugging Face folder at `out`.

    Args:
        path: A step folder.
        tokenizer: The folder to copy the tokenizer from; default the one the
            manifest names (a warning when there is none).
        config: A Hugging Face folder or config.json naming the architecture,
            for a checkpoint whose manifest records none (or to override it).
        check: Verify the folder first; False when the caller just did.

    Returns:
        `write_hf_folder`'s result, plus "step", "path", "format": "hf", "warnings".

    Raises:
        CheckpointError: It does not verify, has no HF form, or does not fit the config.
        OSError: `out` cannot be written.
    """
    path, out = Path(path), Path(out)
    note = Notes(warn)
    manifest = verify(path) if check else read_manifest(path)
    entry = hf_export.model_entry(manifest)
    override, override_folder = hf_export.read_config(config) if config is not None else (None, None)
    if override is None:
        hf_export.hf_source(entry, str(path))  # refuse before reading the shards
    hf_export.check_out_folder(out)
    tensors, cfg = checkpoint_hf_tensors(path, entry, override, note)
    named = entry or {}
    tok_dir, tok_follow = None, True
    if tokenizer is not None:
        tok_dir = Path(tokenizer).expanduser()
    elif override_folder is not None and hf_export.has_tokenizer(override_folder):
        tok_dir = override_folder
    elif isinstance(named.get("tokenizer"), str) and Path(named["tokenizer"]).is_dir():
        tok_dir, tok_follow = Path(named["tokenizer"]), False
    elif isinstance(named.get("tokenizer"), str):
        note(f"the tokenizer folder the checkpoint names, {named['tokenizer']}, does not exist")
    gen_dir, gen_follow = None, True
    if override_folder is not None:
        gen_dir = override_folder
    elif isinstance(named.get("folder"), str) and Path(named["folder"]).is_dir():
        gen_dir, gen_follow = Path(named["folder"]), False
    result = hf_export.write_hf_folder(out, tensors, cfg, tokenizer=tok_dir,
                                       tokenizer_follow=tok_follow, generation=gen_dir,
                                       generation_follow=gen_follow,
                                       max_shard_bytes=max_shard_bytes, warn=note)
    return {"step": manifest["step"], "path": str(path), "format": "hf", **result,
            "warnings": list(note)}


# -- the conversions ------------------------------------------------------------------

def _hf_named(tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """Tensors of a file renamed to HF names, whichever of the namings they follow
    (kuangchao's wrapper, its built-in llama, else HF's own, checked against the config later)."""
    naming = hf_names.naming_of(tensors)
    if naming is None:
        raise CheckpointError(f"{where} holds no tensors")
    try:
        renamed = hf_names.to_hf_names(tensors, naming)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    return {renamed[k]: v for k, v in tensors.items()}


def _model_entry(config: dict[str, Any], folder: Path | None, tokenizer: Path | None) -> dict[str, Any]:
    return {"kind": "hf", "config": config,
            "folder": str(folder.resolve()) if folder is not None else None,
            "tokenizer": str(tokenizer.resolve()) if tokenizer is not None else None}


def convert(src: str | Path, kind: str, out: str | Path, to: str, *,
            config: str | Path | None = None, tokenizer: str | Path | None = None,
            max_shard_bytes: int = hf_export.DEFAULT_MAX_SHARD_BYTES,
            warn: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Convert `src` (of `kind`) into `out` as `to`.

    A checkpoint `src` is one step folder, verified by the caller.

    Args:
        config: A Hugging Face folder or config.json: the architecture a file
            going into a folder or a checkpoint is checked against; for a
            checkpoint without a "model" entry, its architecture.
        tokenizer: The folder to copy the tokenizer from (into a Hugging Face
            folder) or to record (in a checkpoint's manifest).

    Returns:
        {"from", "to", "src", "out", "tensors", "bytes", "warnings", ...}.

    Raises:
        CheckpointError: A direction that makes no sense, a missing --config, tensors
            that do not fit it, or a source that cannot be read.
        OSError: `out` cannot be written.
    """
    src, out = Path(src), Path(out)
    note = notes = Notes(warn)
    if to not in DIRECTIONS.get(kind, ()):
        raise CheckpointError(f"cannot convert {SOURCE_NAMES.get(kind, kind)} to {to}; the "
                              f"conversions are: {directions()}")
    tok = Path(tokenizer).expanduser() if tokenizer is not None else None
    base = {"from": kind, "to": to, "src": str(src)}
    if kind == CHECKPOINT:
        if to == HF:
            result = export_hf(src, out, tokenizer=tok, config=config, check=False,
                               max_shard_bytes=max_shard_bytes, warn=note)
        else:
            result = export_model(src, out, to, check=False)
        return {**result, **base, "out": str(out), "warnings": list(notes)}

    if kind in FILES and to in (HF, CHECKPOINT) and config is None:
        raise CheckpointError(f"converting {SOURCE_NAMES[kind]} to {to} needs the architecture: "
                              "pass --config HF_FOLDER (a Hugging Face model folder, or its "
                              "config.json)")
    if to == HF:
        hf_export.check_out_folder(out)
    elif to == CHECKPOINT:
        final = checkpoint_folder(out)

    if kind == HF:
        if config is not None:
            note(f"--config {config} is not used: {src}/config.json describes the folder")
        tensors = read_hf_folder(src)
        cfg, cfg_folder = hf_export.read_config(src)
    else:
        tensors = read_weights_file(src, kind)
        cfg, cfg_folder = hf_export.read_config(config) if config is not None else ({}, None)

    if to in FILES:  # the same names, another container
        size = write_weights_file(tensors, out, to, {"converted_from": src.name})
        return {**base, "out": str(out), "tensors": len(tensors), "bytes": size, "format": to,
                "warnings": list(notes)}

    where = str(src)
    hf = tensors if kind == HF else _hf_named(tensors, where)
    layout = hf_export.expected_layout(cfg)
    if not layout.checked:
        note(f"{where}: {layout.note}")
    if tok is None and cfg_folder is not None and hf_export.has_tokenizer(cfg_folder):
        tok = cfg_folder
    if to == HF:
        checked = hf_export.match_layout(hf, layout, where, note)
        result = hf_export.write_hf_folder(out, checked, cfg, tokenizer=tok, generation=cfg_folder,
                                           max_shard_bytes=max_shard_bytes, warn=note)
        return {**result, **base, "format": HF, "warnings": list(notes)}
    # to == CHECKPOINT: both names of tied weights, as the trainer's wrapper holds them.
    checked = hf_export.match_layout(hf, layout, where, note, fill_tied=True)
    try:
        kc = {hf_names.hf_to_kc(k): v for k, v in checked.items()}
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    if tok is None:
        note(f"{final}: its manifest names no tokenizer; pass --tokenizer DIR to record one")
    result = write_checkpoint(kc, final, _model_entry(cfg, cfg_folder, tok),
                              {"kind": kind, "path": str(src.resolve())})
    return {**result, **base, "format": CHECKPOINT, "warnings": list(notes)}
