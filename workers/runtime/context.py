"""What a train function receives: its rank, the spec, checkpoints, reporting."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kuangchao.platform.jobs import debugreq
from kuangchao.platform.jobs.debugreq import DebugRequest
from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.observability import metrics
from kuangchao.platform.spec.jobspec import JobSpec
from kuangchao.workers.checkpoint.manager import CheckpointManager
from kuangchao.workers.collectives import permit
from kuangchao.workers.runtime.debug import Capture
from kuangchao.workers.runtime.heartbeat import Heartbeat
from kuangchao.workers.runtime.joblog import JobLogSink
from kuangchao.workers.runtime.telemetry import WorkerTelemetry

# Seconds-per-step samples the reported median is taken over (the most recent).
STEP_WINDOW = 512


@dataclass
class TrainContext:
    """Handed to every train function, built-in or the user's `module:function`.

    Attributes:
        job_id: The job.
        rank, world_size, local_rank: This process's place in the process group.
        spec: The validated job spec; `spec.args` carries free-form user args.
        device: `cuda:N` when a GPU is assigned, else `cpu`.
        checkpoint: Saves and restores sharded checkpoints for this job.
        dp_rank, dp_size: This rank's data-parallel coordinates: which replica it
            belongs to, and how many there are (workers/parallel/layout.py).
        heartbeat: This rank's heartbeat; `report` moves its step and
            `phase` names what the rank is doing, for hang detection.
        started_at: When this run of the train function began.
        accum_steps: Micro-batches per optimizer step at the current size; an
            elastic job's global batch stays fixed, so this changes with `dp_size`.
        generation: The process-group generation this rank is in.
        joining: This rank joined a running job and gets the state from its peers
            (`kuangchao.workers.trainer.live_resize.sync_state`) instead of a checkpoint.
        live_resize: Resizes and lost peers are handled in this process
            (`kuangchao.workers.trainer.live_resize`); otherwise they end the train function.
        telemetry: This rank's Prometheus gauges (`kuangchao.workers.runtime.telemetry`),
            or None when worker metrics are off.
        gpu_type, emulated_speed: This rank's node's hardware (its catalogue GPU type;
            on a fake cluster, the fraction of full speed it emulates), from the
            controller's node view; they set the rank's speed for balancing work.
        shares: The data-parallel split of each step's samples
            (`kuangchao.workers.data.shares.Shares`); None: even.
        keepers: The job's peer-memory keepers (a `KeeperPlan` or its JSON) as the
            controller passed them to `run`; None: no copies in peers' memory, whatever
            `checkpoint.in_memory` says (workers/checkpoint/peer_memory.py).
    """

    job_id: str
    rank: int
    world_size: int
    local_rank: int
    spec: JobSpec
    device: torch.device
    checkpoint: CheckpointManager
    sink: JobLogSink
    store: JobStore | None = None
    dp_rank: int = 0
    dp_size: int = 1
    heartbeat: Heartbeat | None = None
    started_at: float = field(default_factory=time.time)
    rollbacks: int = 0
    accum_steps: int = 1
    generation: int = 0
    generation_start: int = 0  # the first step trained in this generation
    joining: bool = False
    live_resize: bool = False
    group_store: Any = None
    telemetry: WorkerTelemetry | None = None
    node: str = ""  # this rank's node (kc.io/node)
    gpu_type: str | None = None
    emulated_speed: float | None = None
    shares: Any = None
    keepers: Any = None
    peer_memory: Any = None  # this rank's PeerMemory, made on first use (peer_memory.of)
    balance: Any = None  # the trainer's balancing state (workers/trainer/balanced.py)
    eval_source: Any = None  # the held-out split's batches (`data.eval_fraction`), if any
    # The platform's calls for a user's own function (workers/trainer/own.py), handed in
    # by the runner that starts it; the methods below delegate to it.
    kit: Any = None
    capture: Capture | None = None  # a `kc debug gradient` or `kc profile` in progress
    _captured: set[str] = field(default_factory=set)
    _done: int = 0
    _capture_checked: float = 0.0
    _last_report: dict[str, Any] = field(default_factory=dict)
    _reported_once: bool = False
    _first_after: str = "restart"
    _first_armed_at: float = 0.0  # when `expect_first_step` was called (state in place)
    # (step, perf_counter) of rank 0's last report, and recent seconds per step.
    _step_mark: tuple[int, float] | None = None
    _step_times: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    # -- the platform for your own train function (workers/trainer/own.py) ---------

    def _own(self) -> Any:
        if self.kit is None:
            raise RuntimeError("this context was not made by kuangchao's runner; prepare_model, "
                               "prepare_data and resume work inside a job's train function")
        return self.kit

    def prepare_model(self, model: Any, tp_plan: dict[str, str] | None = None) -> Any:
        """The spec's layout on `model` (DDP, ZeRO/FSDP2, tensor parallelism, recompute,
        compile); returns the module to train. `tp_plan`: module path -> colwise|rowwise,
        default the Hugging Face model's own."""
        return self._own().prepare_model(model, tp_plan)

    def prepare_data(self, dataset: Any = None, collate: Any = None) -> Any:
        """This rank's share of `dataset` (map-style), step by step, in one global order
        that survives restarts and resizes; `dataset=None`: the job's own data section."""
        return self._own().prepare_data(dataset, collate)

    def resume(self, model: Any = None, optimizer: Any = None, scheduler: Any = None) -> int:
        """Restore the newest checkpoint that verifies (model, optimizer, LR schedule, data
        position, RNG); returns the step to start at (0 when there is none)."""
        return self._own().resume(model, optimizer, scheduler)

    def check_numerics(self, step: int, loss: Any, grad_norm: float) -> Any:
        """Before the optimizer steps: raise NumericFault for NaN/Inf or a gradient spike."""
        return self._own().check_numerics(step, loss, grad_norm)

    def step_done(self, step: int, loss: float | None = None, **metrics: Any) -> bool:
        """Report, checkpoint on the spec's interval and at the end, and honour a
        preemption; True when the function should return now."""
        return self._own().step_done(step, loss, **metrics)

    def save(self, step: int, model: Any = None, optimizer: Any = None, scheduler: Any = None) -> Any:
        """A checkpoint now, in the format `resume` reads."""
        return self._own().save(step, model, optimizer, scheduler)

    def log(self, message: str, level: str = "INFO", **fields: Any) -> None:
        """A structured line in the job log (`kc logs`), tagged with this rank."""
        self.sink.emit(message, level=level, module="train", **fields)

    def report(self, step: int, **metrics: Any) -> None:
        """Publish progress. Only rank 0's reports reach the job record.

        Args:
            step: Optimizer steps completed so far.
            **metrics: e.g. loss, tokens_per_s; `initial_loss` is kept from
                the first report that carries a loss. `step_s`, the median
                seconds per optimizer step between this run's reports, is
                added unless given.
        """
        self._done = step
        if self.heartbeat is not None:
            self.heartbeat.set_step(step)
            self.heartbeat.set_phase("train")
        if not self.is_chief or self.store is None:
            return
        if not self._reported_once:
            self._reported_once = True
            self._note_first_step(step)
        progress = {"step": step, "total_steps": self.spec.training.steps,
                    "updated_at": time.time(), **self._step_time(step), **metrics}
        if "loss" in metrics and "initial_loss" not in self._last_report:
            progress["initial_loss"] = metrics["loss"]
        self._last_report.update(progress)
        # A logged step (one carrying a loss) is a point of the loss curve.
        point = ({"step": step, "ts": progress["updated_at"],
                  **{k: (v if math.isfinite(v) else None) for k, v in metrics.items()
                     if isinstance(v, (int, float))},  # JSON has no NaN
                  **self._step_time_of(progress)} if "loss" in metrics else None)
        if self.heartbeat is not None and self.heartbeat.carries_progress:
            self.heartbeat.publish(progress, point)  # goes out with the next beat
            return
        try:
            self.store.set_progress(self.job_id, progress)
            if point is not None:
                self.store.add_metrics(self.job_id, [point])
        except Exception as exc:  # progress is best effort; training goes on
            self.sink.emit(f"progress report failed: {exc}", level="WARNING")

    @staticmethod
    def _step_time_of(progress: dict[str, Any]) -> dict[str, float]:
        return {"step_s": progress["step_s"]} if "step_s" in progress else {}

    def _step_time(self, step: int) -> dict[str, float]:
        """`{"step_s": median}` over the recent intervals between reports, each divided
        by the steps it spans; the first report of a run (model build, restore) only
        starts the clock."""
        now = time.perf_counter()
        mark, self._step_mark = self._step_mark, (step, now)
        if mark is not None and step > mark[0]:
            self._step_times.append((now - mark[1]) / (step - mark[0]))
        return {"step_s": statistics.median(self._step_times)} if self._step_times else {}

    def expect_first_step(self, after: str = "restart") -> None:
        """The next report is the first step after a restore (or a `resize`): record its timings."""
        self._reported_once = False
        self._first_after, self._first_armed_at = after, time.time()
        self._step_mark = None  # the restore or resize is no training step

    @contextmanager
    def collective(self, op: str = "collective", group: str = "world") -> Iterator[None]:
        """Around a collective the train function calls itself: the `collective`
        phase for hang detection, its time counted as communication, and its
        name shown by `kc debug comm` while it waits."""
        with self.phase("collective"):
            if self.telemetry is None:
                yield
            else:
                with self.telemetry.clock.timing(op, group):
                    yield

    def phase(self, name: str):
        """Mark what this rank is doing (`with ctx.phase("checkpoint"): ...`).

        A rank whose step and phase stay the same for `hang_timeout_s` is
        judged hung, so long operations should name their phase.
        """
        return self.heartbeat.in_phase(name) if self.heartbeat is not None else nullcontext()

    def _note_first_step(self, step: int) -> None:
        """The first step after a restore or at a new size: report its timings to the
        controller, which closes the resize entry and stamps the restart entry (a rank
        never writes the job record; platform/execution/reports.py)."""
        now = time.time()
        # `step`, `generation` and `first_step_s` let the controller close a live recovery
        # (the survivors' first step: `survivor_stall_s`, platform/execution/reports.py).
        report: dict[str, Any] = {"kind": "first_step", "at": now, "world_size": self.world_size,
                                  "step": step, "generation": self.generation,
                                  "after": self._first_after}
        if self._first_after == "resize" and self._first_armed_at:
            report["first_step_s"] = now - self._first_armed_at
        if self._first_after != "resize":  # a resize by a restart ends here too, and restarts
            ckpt = self.checkpoint
            load_s = getattr(ckpt, "last_load_s", None)
            load_end = getattr(ckpt, "last_load_end", None)
            report["restart"] = {"first_step_at": now,
                                 "resumed_step": getattr(ckpt, "last_restored_step", None),
                                 "restore_s": load_s,
                                 "first_step_s": now - (load_end if load_end else self.started_at)}
            if load_s is not None:
                self.store.recorder(self.job_id).observe(  # type: ignore[union-attr]
                    metrics.CHECKPOINT_LOAD, load_s, job=self.job_id)
        try:
            self.store.post_report(self.job_id, report)  # type: ignore[union-attr]
        except Exception as exc:  # timings are best effort; training goes on
            self.sink.emit(f"could not report the first step's timings: {exc}", level="WARNING")

    def should_stop(self) -> bool:
        """True once a cancel was requested; cooperative train loops poll it."""
        if self.heartbeat is not None and "cancel" in self.heartbeat.flag_keys:
            return self.heartbeat.flags.get("cancel", False)
        try:
            return self.store is not None and self.store.cancel_requested(self.job_id)
        except Exception:  # Redis away: keep training; the controller decides
            return False

    def preemption_requested(self) -> bool:
        """Whether the scheduler asked this job to checkpoint and yield its GPUs.

        A collective: every rank must call it at the same step, and all get the
        same answer, so they stop (and checkpoint) together.
        """
        return self.control()[0]

    def control(self) -> tuple[bool, int]:
        """Rank 0's view of the job's requests, agreed by every rank in one collective.

        Returns:
            Whether a preemption is asked, and the generation to rejoin (0: none).
            Every rank must call it at the same step.
        """
        preempt, rejoin = 0.0, 0.0
        capture = float(self._capture_requested()) if self.is_chief else 0.0
        if self.is_chief:
            if self.heartbeat is not None and "preempt" in self.heartbeat.flag_keys:
                preempt = float(self.heartbeat.flags.get("preempt", False))
            else:
                preempt = float(self._asked(lambda s: s.preempt_requested(self.job_id)))
            if self.live_resize and (self.spec.elastic_range.elastic
                                     or self.spec.survivors_keep_work):
                # Read every step, not with the heartbeat: a resize waits on it. (A job of
                # one size whose survivors keep their work moves replicas off a draining
                # node this way; for a lost peer its group breaks by itself.)
                gen = float(self._asked(lambda s: s.rejoin_requested(self.job_id)))
                rejoin = gen if gen > self.generation else 0.0
        if self.world_size == 1 or not dist.is_initialized():
            self._arm(bool(capture))
            return bool(preempt), int(rejoin)
        flags = torch.tensor([preempt, rejoin, capture], dtype=torch.float64)
        permit("all_reduce")  # the capability token decides, as for any collective
        with self.collective("all_reduce (control flags)"):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self._arm(bool(flags[2].item()))
        return bool(flags[0].item()), int(flags[1].item())

    def any_rank(self, flag: bool, what: str) -> bool:
        """Whether `flag` holds on any rank: one collective every rank calls at the same point."""
        if self.world_size == 1 or not dist.is_initialized():
            return flag
        flags = torch.tensor([float(flag)], dtype=torch.float64)
        permit("all_reduce")
        with self.collective(f"all_reduce ({what})"):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0].item())

    def _pending_capture(self) -> DebugRequest | None:
        if self.store is None:
            return None
        try:
            req = self.store.debug_request(self.job_id)
        except Exception:  # Redis away: the capture waits for it
            return None
        if req is None or req.kind not in debugreq.SYNCED_KINDS or req.id in self._captured:
            return None
        return req

    def _capture_requested(self) -> bool:
        """Rank 0: a gradient or profile capture is asked for (seen with the heartbeat)."""
        if self.capture is not None or self.heartbeat is None:
            return False
        if not self.heartbeat.flags.get("debug"):
            return False
        # At most one read per heartbeat period: the request key can outlive its answers.
        now = time.monotonic()
        if now - self._capture_checked < self.heartbeat.interval_s:
            return False
        self._capture_checked = now
        return self._pending_capture() is not None

    def _arm(self, agreed: bool) -> None:
        """Every rank: take up the capture all agreed on, from the next step."""
        if not agreed or self.capture is not None:
            return
        req = self._pending_capture()
        if req is None:  # replaced meanwhile: rank 0 sees the new one next step
            return
        self._captured.add(req.id)
        self.capture = Capture(req, self._done + 1)

    def _asked(self, read: Any) -> Any:
        try:
            return read(self.store) if self.store is not None else 0
        except Exception:  # Redis away: nothing can have been asked meanwhile
            return 0

    def regroup(self, rank: int, world_size: int, accum_steps: int, generation: int) -> None:
        """Take up a new place after a resize: rank, size, accumulation, checkpoint shard."""
        self.rank, self.world_size = rank, world_size
        self.dp_rank, self.dp_size = rank, world_size
        self.accum_steps, self.generation = accum_steps, generation
        self.shares = None  # even until the new group's speeds are exchanged
        self.checkpoint.regroup(rank, world_size)
        self.sink.rank = rank
        self._step_mark = None  # the resize is no training step
        if self.heartbeat is not None:
            self.heartbeat.rename(rank)
