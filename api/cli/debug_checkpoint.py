"""`kc debug checkpoint ID|PATH`: every file of a checkpoint against its manifest, and
what the manifest records (model, layout, data position). Registered on `debug_app`
by api/cli/debug.py. The job's code wrote the folder: files are opened relative to
the folder's descriptor, never through a symlink.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Annotated, Any

import typer

from kuangchao.api.cli.common import Json, fail
from kuangchao.api.cli.debug import debug_app
from kuangchao.api.cli.render import terminal_safe


def _open_in(dir_fd: int, name: str) -> Any:
    """`name` in the folder open as `dir_fd`, for reading, not through a symlink."""
    fd = os.open(name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
                 dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise IsADirectoryError(name)
    return os.fdopen(fd, "rb")


def _digest(dir_fd: int, name: str, algorithm: str) -> str:
    from kuangchao.platform.protocol.checkpoint import Checksum

    digest = Checksum(algorithm)
    with _open_in(dir_fd, name) as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _file_row(dir_fd: int, name: Any, meta: Any, algorithm: str | None) -> dict[str, Any]:
    """One manifest entry checked: status ok, missing, symlink, not_a_file, size_mismatch,
    checksum_mismatch or bad_entry."""
    from kuangchao.workers.checkpoint.paths import plain_name

    row: dict[str, Any] = {"name": str(name), "bytes": None,
                           "expected_bytes": meta.get("bytes") if isinstance(meta, dict) else None}
    if not isinstance(name, str) or not plain_name(name) or not isinstance(meta, dict):
        return {**row, "status": "bad_entry", "reason": "not a file name of the folder, or no "
                "size and digest"}
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return {**row, "status": "missing", "reason": "listed in the manifest, not in the folder"}
    if stat.S_ISLNK(st.st_mode):
        return {**row, "status": "symlink", "reason": "a symlink (not read); a checkpoint holds "
                "plain files"}
    if not stat.S_ISREG(st.st_mode):
        return {**row, "status": "not_a_file", "reason": "not a regular file"}
    row["bytes"] = st.st_size
    if st.st_size != meta.get("bytes"):
        return {**row, "status": "size_mismatch",
                "reason": f"{st.st_size} bytes, the manifest says {meta.get('bytes')}"}
    if algorithm is None:
        return {**row, "status": "ok", "reason": "size matches; the checksum is of an unknown kind"}
    expected = meta.get(algorithm)
    try:
        actual = _digest(dir_fd, name, algorithm)
    except OSError as exc:
        return {**row, "status": "unreadable", "reason": exc.strerror or str(exc)}
    row[algorithm] = actual
    if actual != expected:
        return {**row, "status": "checksum_mismatch",
                "reason": f"{algorithm} {actual}, the manifest says {expected}"}
    return {**row, "status": "ok", "reason": None}


def _tensor_summary(dir_fd: int, where: str) -> dict[str, Any]:
    """What the DCP metadata lists, read with the restricted unpickler: model tensors,
    parameters, dtypes, optimizer entries."""
    import math

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from kuangchao.workers.checkpoint.dcp_reader import load_metadata

    with _open_in(dir_fd, ".metadata") as f:
        metadata = load_metadata(f, where)
    model = {k: m for k, m in metadata.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    dtypes: dict[str, int] = {}
    for m in model.values():
        key = str(m.properties.dtype).removeprefix("torch.")
        dtypes[key] = dtypes.get(key, 0) + 1
    return {"model_tensors": len(model),
            "model_values": sum(math.prod(m.size) for m in model.values()),
            "model_dtypes": dtypes,
            "optimizer_entries": sum(1 for k in metadata.state_dict_metadata if k.startswith("optim.")),
            "other_entries": sum(1 for k in metadata.state_dict_metadata
                                 if not k.startswith(("model.", "optim.")))}


def inspect_checkpoint(path: Path) -> dict[str, Any]:
    """Every file of a step folder against its manifest, and the manifest's metadata.

    Nothing is read through a symlink: the folder is opened once and every
    file in it with O_NOFOLLOW. `problems` lists every finding; `verified` is
    True when there is none.
    """
    from kuangchao.platform.protocol.checkpoint import (
        CHECKSUMS,
        MANIFEST,
        READABLE_FORMATS,
        step_of,
    )
    from kuangchao.workers.errors import CheckpointError

    problems: list[str] = []
    report: dict[str, Any] = {"path": str(path), "verified": False, "problems": problems}
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        dir_fd = os.open(os.path.realpath(path), flags | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        fail(f"{path}: cannot open the checkpoint folder: {exc.strerror or exc}")
    try:
        manifest: dict[str, Any] | None = None
        try:
            with _open_in(dir_fd, MANIFEST) as f:
                manifest = json.loads(f.read().decode())
            if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
                problems.append(f"{MANIFEST} is malformed: no file list")
                manifest = manifest if isinstance(manifest, dict) else None
        except FileNotFoundError:
            problems.append(f"no {MANIFEST}: the checkpoint is partial (a write that never "
                            "finished), and no restore uses it")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            problems.append(f"{MANIFEST} cannot be read: {getattr(exc, 'strerror', None) or exc}")
        m = manifest or {}
        for key in ("format", "step", "created_at", "platform_version", "torch_version",
                    "spec_hash", "world_size", "checksum", "model", "parallel", "data_position",
                    "rng", "converted_from"):
            report[key] = m.get(key)
        if manifest is not None and m.get("format") not in READABLE_FORMATS:
            problems.append(f"format {m.get('format')!r} is not one this kuangchao reads "
                            f"{READABLE_FORMATS}")
        algorithm: str | None = m.get("checksum", "sha256")
        if algorithm not in CHECKSUMS:
            problems.append(f"checksum {algorithm!r} is not one this kuangchao knows {CHECKSUMS}; "
                            "sizes only were checked")
            algorithm = None
        report["checksum"] = algorithm
        folder_step = step_of(path)
        if manifest is not None and folder_step is not None and m.get("step") != folder_step:
            problems.append(f"the manifest says step {m.get('step')!r}, the folder's name "
                            f"{folder_step}")
        files: dict[Any, Any] = m["files"] if isinstance(m.get("files"), dict) else {}
        rows = [_file_row(dir_fd, name, meta, algorithm) for name, meta in files.items()]
        listed = {r["name"] for r in rows}
        for name in sorted(os.listdir(dir_fd)):
            if name == MANIFEST or name in listed:
                continue
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            kind = ("a symlink" if stat.S_ISLNK(st.st_mode) else
                    "a folder" if stat.S_ISDIR(st.st_mode) else "a file")
            rows.append({"name": name, "bytes": st.st_size if stat.S_ISREG(st.st_mode) else None,
                         "expected_bytes": None, "status": "unlisted",
                         "reason": f"{kind} the manifest does not list"})
        for r in rows:
            if r["status"] != "ok":
                problems.append(f"{r['name']}: {r['status'].replace('_', ' ')}: {r['reason']}")
        report["files"] = rows
        meta_row = next((r for r in rows if r["name"] == ".metadata"), None)
        report["tensors"] = None
        if meta_row is not None and meta_row["status"] in ("ok", "unlisted"):
            try:
                report["tensors"] = _tensor_summary(dir_fd, f"{path}/.metadata")
            except CheckpointError as exc:
                problems.append(f".metadata: {exc.message}")
            except OSError as exc:
                problems.append(f".metadata cannot be read: {exc.strerror or exc}")
        elif meta_row is None:
            problems.append(".metadata (the DCP metadata) is not in the folder")
    finally:
        os.close(dir_fd)
    report["verified"] = not problems
    return report


def _show(value: Any) -> str:
    if value is None:
        return "-"
    return json.dumps(value, sort_keys=True) if isinstance(value, dict | list) else str(value)


def _model_line(model: Any) -> str:
    if not isinstance(model, dict):
        return "not recorded (a checkpoint from before kuangchao recorded it)"
    if model.get("kind") == "hf":
        cfg: dict[str, Any] = model["config"] if isinstance(model.get("config"), dict) else {}
        archs = cfg.get("architectures")
        arch = archs[0] if isinstance(archs, list) and archs else "?"
        return (f"Hugging Face {cfg.get('model_type')} ({arch}): {cfg.get('num_hidden_layers')} "
                f"layers, hidden {cfg.get('hidden_size')}, {cfg.get('num_attention_heads')} heads, "
                f"vocab {cfg.get('vocab_size')}; folder {model.get('folder') or '-'}, tokenizer "
                f"{model.get('tokenizer') or '-'}")
    return _show(model)


@debug_app.command("checkpoint")
def checkpoint(target: Annotated[str, typer.Argument(
                   metavar="JOB_ID|PATH",
                   help="A job id, a job's checkpoint folder (its newest), or one step folder.")],
               as_json: Json = False) -> None:
    """Check every file of a checkpoint against its manifest (size, checksum; missing or
    unlisted files) and show its metadata: format, versions, step, world size, model,
    parallel layout, data position. Exit 0 when it all verifies, 1 when not."""
    from kuangchao.api.cli.checkpoint import newest
    from kuangchao.workers.checkpoint.paths import leads_inside

    path, inside = newest(target)
    if not leads_inside(path, inside):
        fail(f"{path} leads outside {inside} (a symlink); kc reads no checkpoint through one: "
             "pass the real folder")
    report = inspect_checkpoint(path)
    if as_json:
        typer.echo(json.dumps(report, indent=1))
        raise typer.Exit(0 if report["verified"] else 1)
    say = lambda text: typer.echo(terminal_safe(text))  # noqa: E731
    say(f"checkpoint {path}")
    say(f"  step {_show(report['step'])}, format {_show(report['format'])}, written by kuangchao "
        f"{_show(report['platform_version'])} with torch {_show(report['torch_version'])}, world "
        f"size {_show(report['world_size'])}")
    say(f"  model: {_model_line(report['model'])}")
    say(f"  layout: {_show(report['parallel'])}")
    say(f"  data position: {_show(report['data_position'])}")
    if report.get("converted_from"):
        say(f"  converted from: {_show(report['converted_from'])}")
    t = report.get("tensors")
    if t:
        say(f"  tensors: {t['model_tensors']} of the model ({t['model_values']:,} values, "
            f"{_show(t['model_dtypes'])}), {t['optimizer_entries']} of the optimizer")
    say(f"  files ({report['checksum'] or 'size only'}):")
    for r in report.get("files", []):
        size = "-" if r["bytes"] is None else f"{r['bytes']:,}"
        say(f"    {r['status'].upper():<18} {size:>14}  {r['name']}"
            + (f"  ({r['reason']})" if r["status"] != "ok" and r["reason"] else ""))
    if report["verified"]:
        say("verified: every file matches the manifest")
    else:
        say(f"NOT VERIFIED: {len(report['problems'])} problem(s)")
        for p in report["problems"]:
            say(f"  - {p}")
    raise typer.Exit(0 if report["verified"] else 1)
