"""A rank's training metrics and the endpoint Prometheus scrapes them from.

Each rank serves its own `/metrics` (prometheus_client's HTTP server, on a
free port of its node's address) and registers the address in the job's
Redis key space; the control plane turns those into a file_sd list
(`platform/observability/scrape_targets.py`). The series served here carry no
`job`, `rank` or `node`: Prometheus adds those from the target's labels, which
the control plane takes from the job's placement, and does not honour the ones
an endpoint serves (a rank's code could serve any), so every stored
`kc_worker_*` series still has all three.

The train loop only assigns floats (`end_step`); families are built when
Prometheus scrapes, and memory is read then too. Communication time is the
union of the intervals with a collective in flight: DDP's bucket all-reduces
(timed by a comm hook, from launch to completion) and kuangchao's own
collectives (`TrainContext.collective()`).
"""

from __future__ import annotations

import logging
import os
import resource
import time
from collections.abc import Iterator
from typing import Any

import torch
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric

from kuangchao.platform.observability import metrics as m
from kuangchao.workers.parallel.comm_clock import CommClock

_log = logging.getLogger(__name__)
DISABLE_ENV = "KC_WORKER_METRICS"  # "0": no endpoint, no timing (bench/metrics.py's baseline)
ADDR_ENV = "KC_WORKER_METRICS_ADDR"
# The catalogue's worker labels that the scrape target supplies (not served here).
TARGET_LABELS = ("job", "rank", "node")

# Dense bf16 peak FLOP/s by device name (vendor data sheets, without sparsity).
GPU_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12,
                  "V100": 125e12}


def enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1") not in ("0", "false", "off", "no")


def peak_flops(device: torch.device) -> float:
    """The device's peak: from the catalogue for a GPU, measured once for a CPU."""
    override = os.environ.get("KC_PEAK_FLOPS")
    if override:
        return float(override)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in GPU_PEAK_FLOPS.items():
            if key in name:
                return flops
        _log.warning("no peak FLOP/s known for %s: set KC_PEAK_FLOPS for an MFU estimate", name)
        return 0.0  # no MFU rather than a wrong one
    return _measured_cpu_flops()


_cpu_peak: float | None = None


def _measured_cpu_flops(n: int = 256, reps: int = 8) -> float:
    """fp32 matmul throughput with this process's threads: an honest CPU peak."""
    global _cpu_peak
    if _cpu_peak is None:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)  # warm-up
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        _cpu_peak = 2 * n ** 3 * reps / max(time.perf_counter() - t0, 1e-9)
    return _cpu_peak


class WorkerTelemetry:
    """One rank's gauges. The train loop calls `begin_step`/`end_step`."""

    def __init__(self, job_id: str, rank: int, node: str) -> None:
        self.job_id, self.rank, self.node = job_id, rank, node
        self.clock = CommClock()
        self.values: dict[str, float] = {}
        self.flops_per_token = 0.0
        self.peak = 0.0
        self._step_start: float | None = None
        self._server: Any = None
        self.address: str | None = None
        # For `kc debug`: the train function's model and optimizer, and any process
        # groups beyond the world (named), set by the trainer.
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.groups: dict[str, Any] = {}
        # The job's last link probe as this rank saw it (workers/trainer/links.py):
        # {"at", "rates": {node: Gbit/s or None}, "best_gbps", "slow": [node]}; replaced
        # whole, never edited, since `kc debug comm` reads it from the heartbeat thread.
        self.links: dict[str, Any] | None = None

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    # -- what training calls ---------------------------------------------------
    def configure(self, flops_per_token: float, device: torch.device) -> None:
        self.flops_per_token = flops_per_token
        self.peak = peak_flops(device)
        self.values[m.WORKER_PEAK_FLOPS.name] = self.peak

    def begin_step(self) -> None:
        self._step_start = time.perf_counter()

    def observe_numerics(self, loss: float, grad_norm: float, lr: float) -> None:
        """Set before the gradient guard judges them: a NaN shows even when it is rolled back."""
        v = self.values
        v[m.WORKER_LOSS.name], v[m.WORKER_GRAD_NORM.name], v[m.WORKER_LR.name] = (
            loss, grad_norm, lr)

    def end_step(self, step: int, samples: int, tokens: int) -> None:
        end = time.perf_counter()
        start = self._step_start if self._step_start is not None else end
        took = max(end - start, 1e-9)
        comm = self.clock.busy_within(start, end)
        v = self.values
        v[m.WORKER_STEP.name] = step
        v[m.WORKER_STEP_SECONDS.name] = took
        v[m.WORKER_TOKENS.name] = tokens / took
        v[m.WORKER_SAMPLES.name] = samples / took
        v[m.WORKER_COMM_SECONDS.name] = comm
        v[m.WORKER_COMM_SHARE.name] = min(1.0, comm / took)
        if self.peak > 0:
            v[m.WORKER_MFU.name] = self.flops_per_token * tokens / took / self.peak

    # -- what Prometheus reads ---------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        for d in m.WORKER:
            own = [label for label in d.labels if label not in TARGET_LABELS]
            if d is m.WORKER_MEMORY:
                fam = GaugeMetricFamily(d.name, d.help, labels=own)
                for kind, value in memory().items():
                    fam.add_metric([kind], value)
                yield fam
            elif d.name in self.values:
                fam = GaugeMetricFamily(d.name, d.help, labels=own)
                fam.add_metric([], float(self.values[d.name]))
                yield fam

    def serve(self, host: str) -> str:
        """Start the endpoint on a free port of `host`; returns `host:port`."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        self._server, _ = start_http_server(0, addr=host, registry=registry)
        self.address = f"{host}:{self._server.server_port}"
        return self.address

    def close(self) -> None:
        self.model = self.optimizer = None
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def memory() -> dict[str, float]:
    """Resident set size, and CUDA allocated/reserved when this process uses a GPU."""
    out = {"rss": float(_rss_bytes())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_allocated"] = float(torch.cuda.memory_allocated())
        out["cuda_reserved"] = float(torch.cuda.memory_reserved())
    return out


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux: the peak is the best there is
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def register(store: Any, telemetry: WorkerTelemetry) -> None:
    """Publish this rank's endpoint; best effort (metrics never fail a job)."""
    if telemetry.address is None:
        return
    entry = {"addr": telemetry.address, "node": telemetry.node, "pid": os.getpid(),
             "ts": time.time()}
    try:
        store.register_target(telemetry.job_id, telemetry.rank, entry)
    except Exception as exc:  # noqa: BLE001
        _log.warning("could not register the metrics endpoint: %s", exc)


def unregister(store: Any, telemetry: WorkerTelemetry) -> None:
    """Take this rank's entry away, unless another process has taken the rank since."""
    try:
        store.unregister_target(telemetry.job_id, telemetry.rank, os.getpid())
    except Exception:  # noqa: BLE001 -- the control plane drops stale entries anyway
        pass


def model_flops_per_token(n_params: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the weights plus 12 L d T for attention scores
    (forward and backward), as in the usual MFU estimate."""
    return 6.0 * n_params + 12.0 * n_layers * d_model * seq_len
