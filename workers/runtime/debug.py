"""A rank's side of `kc debug` and `kc profile` (see platform/jobs/debugreq.py).

`DebugResponder` runs on the heartbeat thread: it answers `comm` and
`memory` requests at once, so a rank stuck in a collective still answers.
`gradient` and `profile` captures are armed by the train loop at a step
every rank agreed on (`TrainContext.control`).
"""

from __future__ import annotations

import gzip
import hashlib
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kuangchao.platform.jobs.debug_requests import queue_answer, read_request
from kuangchao.platform.jobs.debugreq import DebugRequest
from kuangchao.platform.storage.access import cache_dir, open_filesystem
from kuangchao.platform.storage.urls import is_url
from kuangchao.platform.storage.urls import parse as parse_url
from kuangchao.workers.runtime.telemetry import WorkerTelemetry, memory

# Profiler events that are communication rather than compute.
COMM_EVENT = re.compile(r"gloo|nccl|c10d|all_?reduce|all_?gather|broadcast|reduce_?scatter|"
                        r"send|recv|barrier", re.IGNORECASE)


def comm_state(telemetry: WorkerTelemetry, generation: int) -> dict[str, Any]:
    """This rank's process groups, its pending and last collective, and the job's last
    link probe (None before the first)."""
    groups = []
    if dist.is_available() and dist.is_initialized():
        world = dist.group.WORLD
        groups.append({"name": "world", "backend": str(dist.get_backend()),
                       "rank": dist.get_rank(), "size": dist.get_world_size(),
                       "ranks": list(dist.get_process_group_ranks(world)),
                       "generation": generation})
        for name, pg in telemetry.groups.items():
            groups.append({"name": name, "backend": str(dist.get_backend(pg)),
                           "rank": dist.get_rank(pg), "size": dist.get_world_size(pg),
                           "ranks": list(dist.get_process_group_ranks(pg)),
                           "generation": generation})
    pending, last = telemetry.clock.in_flight()
    return {"rank": telemetry.rank, "node": telemetry.node, "groups": groups,
            "pending": pending, "last": last, "collectives_done": telemetry.clock.count,
            "links": telemetry.links}


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def memory_state(telemetry: WorkerTelemetry) -> dict[str, Any]:
    """Bytes by category: parameters, gradients, optimizer state, and the process's
    RSS (and CUDA allocated/reserved/peak on a GPU)."""
    out: dict[str, Any] = {"rank": telemetry.rank, "node": telemetry.node, **memory()}
    model, optimizer = telemetry.model, telemetry.optimizer
    if model is not None:
        params = list(model.parameters())
        out["parameters"] = _tensor_bytes(params)
        out["gradients"] = _tensor_bytes(p.grad for p in params if p.grad is not None)
        out["buffers"] = _tensor_bytes(model.buffers())
    if optimizer is not None:
        out["optimizer_state"] = sum(_tensor_bytes(s.values()) for s in optimizer.state.values())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_peak_allocated"] = float(torch.cuda.max_memory_allocated())
    return out


class DebugResponder:
    """Called after each heartbeat while a debug request is pending. It runs on the
    heartbeat thread and uses that thread's own client (tight timeouts: a stalled
    Redis must not hold the beats), through the store's own read and write
    (read_request, queue_answer)."""

    def __init__(self, client: Any, prefix: str, job_id: str, telemetry: WorkerTelemetry,
                 generation: Any) -> None:
        self.client, self.prefix, self.job_id = client, prefix, job_id
        self.telemetry, self.generation = telemetry, generation
        self._answered: set[str] = set()

    def __call__(self) -> None:
        req = read_request(self.client, self.prefix, self.job_id)
        if req is None or req.kind not in ("comm", "memory") or req.id in self._answered:
            return
        self._answered.add(req.id)
        body = (comm_state(self.telemetry, self.generation()) if req.kind == "comm"
                else memory_state(self.telemetry))
        with self.client.pipeline(transaction=False) as pipe:
            queue_answer(pipe, self.prefix, self.job_id, req.id, self.telemetry.rank, body)
            pipe.execute()


def gradient_fingerprints(model: torch.nn.Module) -> dict[str, list[Any]]:
    """Per parameter: norm, sum, max |g| and a digest of the gradient's bits."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        g = g.detach().float().cpu().contiguous()
        digest = hashlib.sha256(g.numpy().tobytes()).hexdigest()[:16]
        out[name] = [float(g.norm()), float(g.sum()), float(g.abs().max()) if g.numel() else 0.0,
                     digest]
    return out


class Capture:
    """A gradient or profile capture every rank armed at the same step."""

    def __init__(self, req: DebugRequest, first_step: int) -> None:
        self.req = req
        self.step = max(first_step, req.step or 0) if req.kind == "gradient" else first_step
        self.profiler: Any = None
        self.recorded = 0
        self.first = first_step

    # -- gradient --------------------------------------------------------------
    def gradients_due(self, step: int) -> bool:
        return self.req.kind == "gradient" and step >= self.step

    # -- profile ---------------------------------------------------------------
    def start_profile(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.profiler = profile(activities=activities, record_shapes=False)
        self.profiler.__enter__()

    def profile_done(self) -> bool:
        """Count a recorded step; whether all the steps asked for are in."""
        self.recorded += 1
        return self.recorded >= self.req.steps

    def finish_profile(self, out_dir: Path, rank: int) -> dict[str, Any]:
        """Stop, write this rank's Chrome trace, and summarise it."""
        prof, self.profiler = self.profiler, None
        prof.__exit__(None, None, None)
        out_dir.mkdir(parents=True, exist_ok=True)
        raw = out_dir / f".rank{rank}.tmp.json"
        prof.export_chrome_trace(str(raw))
        final = out_dir / f"rank{rank}.json.gz"
        with open(raw, "rb") as src, gzip.open(final, "wb") as dst:
            dst.write(src.read())
        raw.unlink()
        return summarize(prof, final)


def summarize(prof: Any, trace: Path, top: int = 15) -> dict[str, Any]:
    """The top operators by self time, and compute against communication."""
    events = prof.key_averages()
    rows, comm_us, total_us = [], 0.0, 0.0
    for e in events:
        self_us = float(getattr(e, "self_device_time_total", 0) or 0) + float(e.self_cpu_time_total)
        total_us += self_us
        if COMM_EVENT.search(e.key):
            comm_us += self_us
        rows.append({"op": e.key, "calls": int(e.count), "self_ms": self_us / 1000.0,
                     "comm": bool(COMM_EVENT.search(e.key))})
    rows.sort(key=lambda r: -r["self_ms"])
    return {"trace": trace.name, "trace_bytes": trace.stat().st_size, "top_ops": rows[:top],
            "comm_ms": comm_us / 1000.0, "compute_ms": (total_us - comm_us) / 1000.0,
            "comm_share": comm_us / total_us if total_us else 0.0, "ts": time.time()}


def profile_dir(checkpoint_path: str, job_id: str, request_id: str) -> Path:
    """Next to the job's checkpoints: storage every node (and the API server) can reach.
    For an object store, a folder of this node's own first (`publish_profile` uploads)."""
    if is_url(checkpoint_path):
        return cache_dir("profiles") / job_id / request_id
    return Path(checkpoint_path).expanduser() / job_id / "profiles" / request_id


def publish_profile(checkpoint_path: str, job_id: str, request_id: str, trace: Path) -> None:
    """Upload a trace written under `profile_dir` to `{checkpoint.path}/{job_id}/profiles/`
    when the checkpoints are in an object store (the API serves it from there), with
    the job's own credentials; then drop the local copy. A folder path: nothing to do."""
    if not is_url(checkpoint_path):
        return
    target = parse_url(checkpoint_path).join(job_id, "profiles", request_id, trace.name)
    open_filesystem(target.scheme).put_file(str(trace), target.path)
    trace.unlink(missing_ok=True)
