"""What a train function receives: its rank, the spec, checkpoints, reporting."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kuangchao.platform.spec import JobSpec
from kuangchao.platform.store import JobStore
from kuangchao.workers.checkpoint import CheckpointManager
from kuangchao.workers.heartbeat import Heartbeat
from kuangchao.workers.joblog import JobLogSink


@dataclass
class TrainContext:
    """Handed to every train function, built-in or the user's `module:function`.

    Attributes:
        job_id: The job.
        rank, world_size, local_rank: This process's place in the process group.
        spec: The validated job spec; `spec.args` carries free-form user args.
        device: `cuda:N` when a GPU is assigned, else `cpu`.
        checkpoint: Saves and restores sharded checkpoints for this job.
        dp_rank, dp_size: Data-parallel coordinates (equal to rank and
            world_size until tensor/pipeline parallelism lands).
        heartbeat: This rank's heartbeat; `report` moves its step and
            `phase` names what the rank is doing, for hang detection.
        started_at: When this run of the train function began.
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
    _last_report: dict[str, Any] = field(default_factory=dict)
    _reported_once: bool = False

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    def log(self, message: str, level: str = "INFO", **fields: Any) -> None:
        """A structured line in the job log (`kc logs`), tagged with this rank."""
        self.sink.emit(message, level=level, module="train", **fields)

    def report(self, step: int, **metrics: Any) -> None:
        """Publish progress. Only rank 0's reports reach the job record.

        Args:
            step: Optimizer steps completed so far.
            **metrics: e.g. loss, tokens_per_s; `initial_loss` is kept from
                the first report that carries a loss.
        """
        if self.heartbeat is not None:
            self.heartbeat.set_step(step)
            self.heartbeat.set_phase("train")
        if not self.is_chief or self.store is None:
            return
        if not self._reported_once:
            self._reported_once = True
            self._note_first_step(step)
        progress = {"step": step, "total_steps": self.spec.training.steps,
                    "updated_at": time.time(), **metrics}
        if "loss" in metrics and "initial_loss" not in self._last_report:
            progress["initial_loss"] = metrics["loss"]
        self._last_report.update(progress)
        if self.heartbeat is not None and self.heartbeat.progress_key:
            self.heartbeat.publish(progress)  # goes out with the next beat
            return
        try:
            self.store.set_progress(self.job_id, progress)
        except Exception as exc:  # progress is best effort; training goes on
            self.sink.emit(f"progress report failed: {exc}", level="WARNING")

    def expect_first_step(self) -> None:
        """The next report is the first step after a restore: record its timings."""
        self._reported_once = False

    def phase(self, name: str):
        """Mark what this rank is doing (`with ctx.phase("checkpoint"): ...`).

        A rank whose step and phase stay the same for `hang_timeout_s` is
        judged hung, so long operations should name their phase.
        """
        return self.heartbeat.in_phase(name) if self.heartbeat is not None else nullcontext()

    def _note_first_step(self, step: int) -> None:
        """After a recovery, record restore and first-step timings on the restart."""
        now = time.time()
        ckpt = self.checkpoint
        load_s = getattr(ckpt, "last_load_s", None)
        load_end = getattr(ckpt, "last_load_end", None)
        fields = {"first_step_at": now, "resumed_step": getattr(ckpt, "last_restored_step", None),
                  "restore_s": load_s,
                  "first_step_s": now - (load_end if load_end else self.started_at)}
        try:
            self.store.annotate_restart(self.job_id, fields)  # type: ignore[union-attr]
        except Exception as exc:  # timings are best effort; training goes on
            self.sink.emit(f"could not record recovery timings: {exc}", level="WARNING")

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
        if self.heartbeat is not None and "preempt" in self.heartbeat.flag_keys:
            local = float(self.is_chief and self.heartbeat.flags.get("preempt", False))
        else:
            try:
                local = float(self.is_chief and self.store is not None
                              and self.store.preempt_requested(self.job_id))
            except Exception:  # Redis away: no preemption can have been asked meanwhile
                local = 0.0
        if self.world_size == 1 or not dist.is_initialized():
            return bool(local)
        flag = torch.tensor([local])
        with self.phase("collective"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
