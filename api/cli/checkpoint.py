"""`kc checkpoint`: list, verify, export and convert a job's checkpoints.

Every command takes a job id (looked up in Redis for its `checkpoint.path`),
a job's checkpoint folder (`{checkpoint.path}/{job_id}`), or one step folder
(`.../step_00000200`). Bad input exits 2 with an `error:` line, as in `kc`.

The job's code wrote those folders, so nothing is read through a symlink: the
folder named must not be one, a step folder must lead nowhere outside it and
hold none, and export reads the DCP metadata with a restricted unpickler
(workers/checkpoint/paths.py, workers/checkpoint/dcp_reader.py).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from kuangchao.api.cli import checkpoint_store
from kuangchao.api.cli.render import terminal_safe
from kuangchao.platform.errors import StorageError
from kuangchao.platform.protocol.checkpoint import (
    MANIFEST,
    read_manifest,
    step_of,
    verify,
)
from kuangchao.platform.spec.defaults import value
from kuangchao.platform.storage.urls import is_url
from kuangchao.platform.storage.urls import parse as parse_url
from kuangchao.workers.checkpoint.paths import anchor, check_step_folder, leads_inside
from kuangchao.workers.errors import CheckpointError

checkpoint_app = typer.Typer(help="List, verify, export and convert checkpoints.",
                              no_args_is_help=True)

Target = Annotated[str, typer.Argument(
    metavar="JOB_ID|PATH", help="A job id, a job's checkpoint folder, or one step folder.")]
Json = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]
LIST_HINT = "`kc checkpoint list {target}` shows every checkpoint and whether it verifies"


def fail(message: str, code: int = 2) -> NoReturn:
    # The same shape as kc's own `fail` (api/cli/main.py imports this module, so it cannot be imported here).
    # Terminal-safe: reasons quote file names the job's code chose.
    typer.echo(f"error: {terminal_safe(message)}", err=True)
    raise typer.Exit(code)


# -- finding the checkpoints --------------------------------------------------

def job_checkpoint_dir(job_id: str) -> Path | str:
    """`{checkpoint.path}/{job_id}` of a job recorded in Redis (a URL for an object store)."""
    from kuangchao.platform.errors import KuangchaoError
    from kuangchao.platform.jobs.store import JobStore
    from kuangchao.platform.settings import Settings, kc_home

    settings = Settings.from_env()
    try:
        job = JobStore.from_url(settings.redis_url, settings.redis_prefix).get(job_id)
    except KuangchaoError as exc:
        fail(f"{job_id!r} is not a folder, and looking it up as a job failed: {exc.message}. "
             "Pass a checkpoint folder instead, e.g. ~/.kuangchao/checkpoints/<job id>")
    raw = value(job.spec, "checkpoint", "path")
    if is_url(raw):
        return str(parse_url(raw).join(job.id))
    root = Path(raw).expanduser()
    if not root.is_absolute():  # records from before paths were resolved at submission
        root = kc_home() / root
    return root / job.id


def store_url(target: str) -> str | None:
    """The object-store URL `target` stands for (a URL, or a job whose checkpoints are
    in a store), else None (a folder: the rest of this module)."""
    if is_url(target):
        return target
    if Path(target).expanduser().exists() or os.sep in target or target.startswith((".", "~")):
        return None
    found = job_checkpoint_dir(target)
    return found if isinstance(found, str) else None


def from_store(do: Callable[[], Any]) -> Any:
    """Run `do`; a store's refusal or a bad checkpoint ends kc with exit 2 and the reason."""
    try:
        return do()
    except (StorageError, CheckpointError) as exc:
        fail(exc.message)


def resolve(target: str) -> Path:
    """The folder `target` names: an existing folder as given, else a job's folder.

    Never a symlink: a job's code may have planted one where its folder should be."""
    path = Path(target).expanduser()
    if not path.exists():
        if os.sep in target or target.startswith((".", "~")):
            fail(f"{path} does not exist; pass an existing checkpoint folder or a job id")
        found = job_checkpoint_dir(target)
        if isinstance(found, str):
            fail(f"job {target}'s checkpoints are in an object store: {found}")
        path = found
    elif not path.is_dir():
        fail(f"{path} is a file; pass a checkpoint folder (a job's or one step_* folder) or a job id")
    if not leads_inside(path, anchor(path)):
        fail(f"{path} is a symlink; a job's code can plant one, so kc checkpoint reads no folder "
             "through one: pass the real folder")
    return path


def is_step_folder(path: Path) -> bool:
    return (step_of(path) is not None or (path / MANIFEST).exists()
            or (path / ".metadata").exists())


def step_folders(folder: Path) -> list[Path]:
    """The step folders `folder` stands for, oldest first: itself, or its `step_*` children."""
    if is_step_folder(folder):
        return [folder]
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=lambda p: step_of(p) or 0)


def newest(target: str) -> tuple[Path, str]:
    """The step folder to verify or export (the given one, or the job's newest), and
    the folder it must stay inside (an `anchor`)."""
    folder = resolve(target)
    found = step_folders(folder)
    if not found:
        fail(f"no checkpoints in {folder}; a job writes its first one after "
             "`checkpoint.interval_steps` steps")
    return found[-1], anchor(folder)


def describe(path: Path, inside: str) -> dict[str, Any]:
    """One step folder: step, bytes, creation time, and whether it verifies (and why not).

    A folder leading outside `inside` or holding a symlink is not read at all."""
    try:
        check_step_folder(path, inside)
    except CheckpointError as exc:
        return {"step": step_of(path), "path": str(path), "bytes": 0, "created_at": None,
                "verified": False, "reason": exc.message, "format": None}
    reason = None
    try:
        manifest: dict[str, Any] | None = verify(path)
    except CheckpointError as exc:
        reason = exc.message
        try:
            manifest = read_manifest(path)  # for step and time; the files may still be bad
        except CheckpointError:
            manifest = None
    if manifest is not None:
        step = manifest.get("step")
        size = sum(int(m.get("bytes", 0)) for m in manifest["files"].values() if isinstance(m, dict))
        created = manifest.get("created_at")
    else:
        step = step_of(path)
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        created = path.stat().st_mtime
    return {"step": step, "path": str(path), "bytes": size, "created_at": created,
            "verified": reason is None, "reason": reason,
            "format": manifest.get("format") if manifest else None}


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


# -- commands -------------------------------------------------------------------

@checkpoint_app.command("list")
def list_(target: Target, as_json: Json = False) -> None:
    """List a job's checkpoints: step, size, time, and whether each verifies.

    In an object store, "verifies" means its manifest and every object at its size
    are there (nothing is downloaded); `kc checkpoint verify` checks the checksums."""
    url = store_url(target)
    if url is not None:
        rows = from_store(lambda: checkpoint_store.rows(url))
        folder: Path | str = url
    else:
        folder = resolve(target)
        rows = [describe(p, anchor(folder)) for p in step_folders(folder)]
    if as_json:
        typer.echo(json.dumps(rows))
        return
    if not rows:
        typer.echo(f"no checkpoints in {folder}")
        return
    typer.echo(f"{'STEP':>8}  {'BYTES':>14}  {'CREATED':<19}  VERIFIED  PATH")
    for r in rows:
        step = "?" if r["step"] is None else r["step"]
        typer.echo(f"{step:>8}  {r['bytes']:>14,}  {_when(r['created_at']):<19}  "
                   f"{'yes' if r['verified'] else 'no':<8}  {r['path']}")
        if r["reason"]:
            typer.echo(f"{'':>10}not verified: {terminal_safe(r['reason'])}")


@checkpoint_app.command("verify")
def verify_(target: Target, as_json: Json = False) -> None:
    """Verify the newest checkpoint of a job or folder, or the given step folder.

    Exit 0 when every file matches the manifest, 2 with the reason when not.
    """
    url = store_url(target)
    if url is not None:  # fetched into this machine's cache and checksummed there
        try:
            row = checkpoint_store.fetch_newest(url)[1]
        except CheckpointError as exc:
            row = {"verified": False, "reason": exc.message, "path": url}
        except StorageError as exc:
            fail(exc.message)
    else:
        row = describe(*newest(target))
    if as_json:
        typer.echo(json.dumps(row))
        if not row["verified"]:
            raise typer.Exit(2)
        return
    if not row["verified"]:
        fail(f"{row['reason']}\n{LIST_HINT.format(target=target)}; a job resumes from the newest "
             "one that verifies")
    typer.echo(f"verified: step {row['step']} at {row['path']} ({row['bytes']:,} bytes, "
               f"format {row['format']})")


Tokenizer = Annotated[Path | None, typer.Option(
    "--tokenizer", help="Folder to copy the tokenizer from (default: the one the checkpoint names).")]
MaxShard = Annotated[str, typer.Option(
    "--max-shard-size", help="Largest safetensors file of a Hugging Face folder, e.g. 5GB, 500MB.")]
EXPORT_FORMATS = ("safetensors", "torch", "hf")


def _warn(message: str) -> None:
    typer.echo(f"warning: {terminal_safe(message)}", err=True)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000, '512MiB' -> 536_870_912, '1000' -> 1000; ValueError if not a size."""
    m = _SIZE.match(text)
    size = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]) if m else 0
    if size <= 0:
        raise ValueError(f"{text!r} is not a size; write e.g. 5GB, 500MB or 2GiB")
    return size


def _shard_bytes(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        fail(f"--max-shard-size: {exc}")


def _verified_step(target: str, doing: str) -> Path:
    """The step folder `target` stands for, refused (exit 2) unless it verifies (from
    an object store: fetched into this machine's cache, then verified there)."""
    url = store_url(target)
    if url is not None:
        try:
            return checkpoint_store.fetch_newest(url)[0]
        except (CheckpointError, StorageError) as exc:
            fail(f"{exc.message}; not {doing} it.\n{LIST_HINT.format(target=target)}")
    path, inside = newest(target)
    try:
        check_step_folder(path, inside)
        verify(path)
    except CheckpointError as exc:
        fail(f"{exc.message}; not {doing} it.\n{LIST_HINT.format(target=target)}; pass the step "
             "folder of one that does")
    return path


@checkpoint_app.command("export")
def export(target: Target,
           out: Annotated[Path, typer.Option("--out", help=(
               "The file to write (safetensors, torch), or the folder (hf)."))],
           fmt: Annotated[str, typer.Option("--format", help=(
               "safetensors or torch (one file of weights), or hf (a Hugging Face model folder)."
               ))] = "safetensors",
           tokenizer: Tokenizer = None,
           max_shard_size: MaxShard = "5GB",
           as_json: Json = False) -> None:
    """Write the model weights of a checkpoint (no optimizer), for inference.

    Takes the newest checkpoint of a job or folder, or the given step folder,
    and refuses one that does not verify. safetensors/torch: one file, keys as
    the model's state_dict keys. hf: a folder `AutoModelForCausalLM.from_pretrained`
    loads (a Hugging Face model's checkpoint, or a built-in llama's).
    """
    if fmt not in EXPORT_FORMATS:
        fail(f"unknown --format {fmt!r}; choose one of: {', '.join(EXPORT_FORMATS)}")
    out = out.expanduser()
    if fmt == "hf":
        _export_hf(target, out, tokenizer, _shard_bytes(max_shard_size), as_json)
        return
    _check_writable(out)
    path = _verified_step(target, "exporting")
    from kuangchao.workers.checkpoint.export import export_model

    result = written(lambda: export_model(path, out, fmt, check=False), out)  # just verified
    if as_json:
        typer.echo(json.dumps(result))
        return
    typer.echo(f"exported {result['tensors']} tensors of step {result['step']} to {result['out']} "
               f"({result['bytes']:,} bytes, {fmt})")


def _export_hf(target: str, out: Path, tokenizer: Path | None, shard_bytes: int,
               as_json: bool) -> None:
    from kuangchao.workers.checkpoint.convert import export_hf
    from kuangchao.workers.checkpoint.hf_export import check_out_folder

    if tokenizer is not None and not tokenizer.expanduser().is_dir():
        fail(f"--tokenizer {tokenizer} is not a folder; name the folder holding tokenizer.json "
             "(or tokenizer.model)")
    try:
        check_out_folder(out)
    except CheckpointError as exc:
        fail(exc.message)
    path = _verified_step(target, "exporting")
    result = written(lambda: export_hf(path, out, tokenizer=tokenizer, check=False,
                                       max_shard_bytes=shard_bytes, warn=None if as_json else _warn),
                     out)
    if as_json:
        typer.echo(json.dumps(result))
        return
    typer.echo(f"exported {result['tensors']} tensors of step {result['step']} to {result['out']} "
               f"as a Hugging Face folder ({result['bytes']:,} bytes in {result['shards']} "
               f"safetensors file(s), {result['dtype']}"
               + (f", tokenizer: {', '.join(result['tokenizer'])})" if result["tokenizer"]
                  else ", no tokenizer)"))


def written(write: Callable[[], dict[str, Any]], out: Path) -> dict[str, Any]:
    """Run `write`; what it refuses or cannot write ends kc with exit 2 and the reason."""
    try:
        return write()
    except CheckpointError as exc:
        fail(exc.message)
    except OSError as exc:
        fail(f"cannot write {out}: {exc.strerror or exc}; choose another --out")


def _check_writable(out: Path) -> None:
    """Fail before the (slow) verification when `out` cannot be written anyway."""
    if out.is_dir():
        fail(f"--out {out} is a folder; give a file name, e.g. {out / 'model.safetensors'}")
    parent = out.parent
    if parent.exists() and not parent.is_dir():
        fail(f"--out {out}: {parent} is not a folder; choose another --out")
    if not parent.exists():
        fail(f"--out {out}: folder {parent} does not exist; create it or choose another --out")
    if not os.access(parent, os.W_OK | os.X_OK):
        fail(f"--out {out}: folder {parent} is not writable; choose another --out")


# `kc checkpoint convert` lives in its own module; importing it registers the command.
from kuangchao.api.cli import checkpoint_convert  # noqa: E402,F401
