"""`kc debug comm|gradient|memory JOB`, `kc debug checkpoint ID|PATH` and
`kc profile JOB --steps N`.

Exit codes: 0 when the diagnosis finds nothing wrong, 1 when it does (a
group whose ranks disagree, replicas whose gradients differ, a rank that did
not answer, a checkpoint file that is missing or altered), 2 for bad input
(unknown job, a job not running, a folder that holds no checkpoint).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import stat
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from kuangchao.api.cli.common import Json, call, client, fail
from kuangchao.api.cli.render import terminal_safe

debug_app = typer.Typer(help="Diagnose a running job's ranks, or a checkpoint on disk.",
                        no_args_is_help=True)
# The API waits at most this long for a diagnosis (api/server/routers/debug.py).
Timeout = Annotated[float, typer.Option("--timeout", min=1, max=120,
                                        help="Seconds to wait for every rank.")]
ProfileTimeout = Annotated[float, typer.Option("--timeout", min=1, max=3600,
                                               help="Seconds to wait for every rank's trace.")]
MiB = 1024 * 1024
# A trace is written by the job's code: unpacked in bounded chunks, never whole
# in memory, and refused past this (a few steps trace to megabytes).
MAX_TRACE_BYTES = 1 << 30


def _write_trace(raw: bytes, path: Path) -> bool:
    """Unpack gzip `raw` into `path`; False (and no file) if it is not gzip or too big."""
    import io

    total = 0
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(raw)) as src, open(path, "wb") as dst:
            while chunk := src.read(1 << 20):
                total += len(chunk)
                if total > MAX_TRACE_BYTES:
                    raise ValueError("too big")
                dst.write(chunk)
    except (OSError, EOFError, ValueError):
        path.unlink(missing_ok=True)
        return False
    return True


def _done(report: dict[str, Any], as_json: bool, bad: bool) -> None:
    if as_json:
        typer.echo(json.dumps(report, indent=1))
    if report.get("missing"):
        typer.echo(f"rank(s) {report['missing']} did not answer (dead, or not yet started?)",
                   err=True)
    raise typer.Exit(1 if bad or report.get("missing") else 0)


@debug_app.command("comm")
def comm(job_id: str, timeout: Timeout = 30.0, as_json: Json = False) -> None:
    """Every rank's process groups (members, backend, rank order) and its pending or
    last collective; groups whose ranks disagree on the order are flagged."""
    report = call(client().debug, job_id, "comm", None, timeout)
    if not as_json:
        for rank, a in report["ranks"].items():
            typer.echo(f"rank {rank} on {a.get('node')}: {a.get('collectives_done', 0)} "
                       "collective(s) done")
            for g in a.get("groups", []):
                typer.echo(f"  group {g['name']:<8} {g['backend']:<5} rank {g['rank']}/"
                           f"{g['size']} members {g['ranks']} (generation {g['generation']})")
            pending, last = a.get("pending"), a.get("last")
            if pending:
                typer.echo(f"  WAITING in {pending['op']} on {pending['group']} for "
                           f"{pending['waited_s']:.2f}s")
            if last:
                typer.echo(f"  last: {last['op']} on {last['group']}, took {last['took_s']:.4f}s, "
                           f"{last['ended_ago_s']:.2f}s ago")
        for p in report["problems"]:
            typer.echo(f"PROBLEM: {p}")
        if report["healthy"]:
            typer.echo("no inconsistency between the ranks' groups")
    _done(report, as_json, not report["healthy"])


@debug_app.command("gradient")
def gradient(job_id: str,
             step: Annotated[int | None, typer.Option("--step", min=1, help=(
                 "The optimizer step to capture (default: the next one)."))] = None,
             timeout: Timeout = 60.0, as_json: Json = False) -> None:
    """Compare the gradients of every data-parallel replica after the all-reduce, and
    name the parameters that differ most (silent divergence)."""
    report = call(client().debug, job_id, "gradient", step, timeout)
    if not as_json:
        for rank, err in (report.get("errors") or {}).items():
            typer.echo(f"rank {rank}: {err}")
        typer.echo(f"step {report['step']}: {report.get('params', 0)} parameter(s) compared "
                   f"across {report['ranks']} replica(s); max divergence "
                   f"{report['max_divergence']:.3g}")
        if report["identical"]:
            typer.echo("every replica holds bit-identical gradients")
        else:
            typer.echo(f"{'PARAMETER':<40} {'DIVERGENCE':>10} {'RANK':>5} {'NORM r0':>12} "
                       f"{'NORM rank':>12}")
            for row in report["diverged"]:
                typer.echo(f"{row['param']:<40} {row['divergence']:>10.3g} {row['rank']:>5} "
                           f"{row['norm_rank0']:>12.6g} {row['norm_rank'] or 0:>12.6g}")
    _done(report, as_json, not report["identical"] or bool(report.get("errors")))


@debug_app.command("memory")
def memory(job_id: str, timeout: Timeout = 30.0, as_json: Json = False) -> None:
    """Per-rank memory by category (MiB): parameters, gradients, optimizer state,
    buffers, resident set, and CUDA allocated/reserved on a GPU."""
    report = call(client().debug, job_id, "memory", None, timeout)
    if not as_json:
        cols = ["parameters", "gradients", "optimizer_state", "buffers", "rss", "cuda_allocated",
                "cuda_reserved"]
        present = [c for c in cols if any(c in a for a in report["ranks"].values())]
        typer.echo(f"{'RANK':>4} {'NODE':<10} " + " ".join(f"{c.upper():>16}" for c in present))
        for rank, a in report["ranks"].items():
            typer.echo(f"{rank:>4} {str(a.get('node')):<10} " + " ".join(
                f"{(a.get(c) or 0) / MiB:>16.1f}" for c in present))
    _done(report, as_json, False)


# -- kc debug checkpoint ---------------------------------------------------------------

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


_TRACE = re.compile(r"rank\d{1,6}\.json\.gz")


def profile(job_id: str,
            steps: Annotated[int, typer.Option("--steps", min=1, max=500,
                                               help="Optimizer steps to record.")] = 5,
            out: Annotated[Path | None, typer.Option("--out", help=(
                "Where to write rankN.json (default ./kc-profile-JOB-ID)."))] = None,
            timeout: ProfileTimeout = 300.0, as_json: Json = False) -> None:
    """Record a torch.profiler trace of the next N steps on every rank; writes one
    Chrome/Perfetto trace per rank and prints the top operators and the
    compute/communication split."""
    c = client()
    started = call(c.start_profile, job_id, steps)
    pid = started["id"]
    deadline = time.monotonic() + timeout
    while True:
        status = call(c.profile, job_id, pid)
        if status["done"]:
            break
        if time.monotonic() > deadline:
            fail(f"profile {pid}: rank(s) {status['missing']} did not finish {steps} step(s) "
                 f"within {timeout:.0f}s; `kc status {job_id}` shows whether it still trains", 1)
        time.sleep(1.0)
    folder = out or Path(f"kc-profile-{job_id}-{pid}")
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name in status["files"]:
        if not isinstance(name, str) or not _TRACE.fullmatch(name):  # never a path: a file name
            fail(f"profile {pid}: the server listed {name!r}, not a trace name (rankN.json.gz)", 1)
        path = folder / name.removesuffix(".gz")
        if not _write_trace(call(c.profile_file, job_id, pid, name), path):
            fail(f"profile {pid}: {name} unpacks to more than {MAX_TRACE_BYTES // MiB} MiB or is "
                 "not gzip; a trace of a few steps is far smaller, so it was not written", 1)
        written.append(str(path))
    status["written"] = written
    errors = {r: a["error"] for r, a in status["ranks"].items() if a.get("error")}
    if as_json:
        typer.echo(json.dumps(status, indent=1))
    else:
        for rank, a in status["ranks"].items():
            if a.get("error"):
                typer.echo(f"rank {rank}: {a['error']}")
                continue
            typer.echo(f"rank {rank}: steps {a['first_step']}..{a['first_step'] + a['steps'] - 1},"
                       f" compute {a['compute_ms']:.1f} ms, communication {a['comm_ms']:.1f} ms "
                       f"({a['comm_share']:.0%})")
        first = next((a for a in status["ranks"].values() if not a.get("error")), None)
        if first:
            typer.echo(f"top operators (rank {next(iter(status['ranks']))}, self time):")
            for row in first["top_ops"][:10]:
                typer.echo(f"  {row['self_ms']:>10.2f} ms {row['calls']:>6}x  {row['op']}"
                           + ("  [comm]" if row["comm"] else ""))
        typer.echo(f"traces: {', '.join(written)} (open in https://ui.perfetto.dev or "
                   "chrome://tracing)")
    raise typer.Exit(1 if errors else 0)
