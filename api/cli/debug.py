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
import re
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from kuangchao.api.cli.common import Json, call, client, fail
from kuangchao.platform.jobs import debugreq

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
        for line in comm_lines(report):
            typer.echo(line)
    _done(report, as_json, not report["healthy"])


def comm_lines(report: dict[str, Any], now: float | None = None) -> list[str]:
    """`kc debug comm`'s human output of a comm report."""
    out = []
    for rank, a in report["ranks"].items():
        out.append(f"rank {rank} on {a.get('node')}: {a.get('collectives_done', 0)} "
                   "collective(s) done")
        for g in a.get("groups", []):
            out.append(f"  group {g['name']:<8} {g['backend']:<5} rank {g['rank']}/"
                       f"{g['size']} members {g['ranks']} (generation {g['generation']})")
        pending, last = a.get("pending"), a.get("last")
        if pending:
            out.append(f"  WAITING in {pending['op']} on {pending['group']} for "
                       f"{pending['waited_s']:.2f}s")
        if last:
            out.append(f"  last: {last['op']} on {last['group']}, took {last['took_s']:.4f}s, "
                       f"{last['ended_ago_s']:.2f}s ago")
    for p in report["problems"]:
        out.append(f"PROBLEM: {p}")
    if report["healthy"]:
        out.append("no inconsistency between the ranks' groups")
    # A server that predates the summary sends the ranks' own view of the probe.
    slow = report.get("slow_links")
    for link in slow if slow is not None else debugreq.slow_links(report["ranks"]):
        at = link.get("at")
        ago = f", measured {(now or time.time()) - at:.0f}s ago" if at is not None else ""
        out.append(f"slow link: {link['node']} ({_gbps(link.get('gbps'))} Gbit/s; best "
                   f"{_gbps(link.get('best_gbps'))}{ago})")
    return out


def _gbps(value: float | None) -> str:
    return "?" if value is None else f"{value:.3g}"


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


# `kc debug checkpoint` lives in its own module; importing it registers the command.
from kuangchao.api.cli import debug_checkpoint  # noqa: E402,F401
