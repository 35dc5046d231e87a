"""A slower GPU on a CPU machine: a fake cluster's per-node `emulated_speed`.

A node of a fake cluster may say its ranks run at a fraction `s` of full speed
(cluster YAML `emulated_speed: 0.5`). After each forward and each backward, such
a rank sleeps `(1/s - 1)` times the CPU time that forward or backward took, so
its compute takes `1/s` as long. The time is the calling thread's CPU time
(`time.thread_time`), not the wall clock: when ranks share cores, a rank waiting
for a core does not count that wait as its own work, and the slowdown stays `s`
however busy the machine is. (With one torch thread, CPU autograd runs on the
calling thread too.) It exists so that the balancing of work over mixed GPU
generations (workers/parallel/balance.py) runs for real on a CPU machine.

Where it measures:
- data parallelism (engine.py): around each micro-batch's forward and its
  `.backward()`;
- pipeline stages: per chunk, around `ModelChunk.forward`, and for backward
  between two markers: `_Close` on the chunk's output starts the clock when the
  gradient arrives, `_Open` on its first activation (after the embedding, on
  the first chunk, whose input is token ids) stops it and sleeps.

Emulation is refused where CUDA is available: a real GPU has its own speed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kuangchao.workers.errors import TrainingError


def check_emulation(speed: float | None, cuda: bool, node: str = "") -> float | None:
    """The speed to emulate (None: full speed), refusing it where real GPUs are.

    Raises:
        TrainingError: For a speed outside (0, 1], or a slowdown on a machine with CUDA.
    """
    if speed is None:
        return None
    if not (0 < speed <= 1 and math.isfinite(speed)):
        raise TrainingError(f"emulated_speed {speed} on node {node or '?'}: give a fraction of full "
                            "speed in (0, 1]")
    if speed < 1 and cuda:
        raise TrainingError(f"emulated_speed {speed} on node {node or '?'}: emulation is for fake "
                            "clusters on CPU, and this node has CUDA GPUs; remove emulated_speed "
                            "from the node (its GPUs run at their own speed)")
    return speed if speed < 1 else None


class Emulation:
    """Stretches a rank's compute by `1/speed`, sleeping after each piece of it.

    Attributes:
        speed: The fraction of full speed, in (0, 1].
        slept: Seconds slept so far (counted as compute by the measured re-balance).
    """

    def __init__(self, speed: float) -> None:
        if not 0 < speed <= 1:
            raise ValueError(f"emulated speed must be in (0, 1], got {speed}")
        self.speed = speed
        self.factor = 1.0 / speed - 1.0
        self.slept = 0.0

    def delay(self, cpu_s: float) -> float:
        """The sleep owed for `cpu_s` seconds of CPU time: `(1/speed - 1) x cpu_s`."""
        return max(0.0, cpu_s) * self.factor

    def pause(self, cpu_s: float) -> None:
        d = self.delay(cpu_s)
        if d > 0:
            time.sleep(d)
            self.slept += d

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Sleep after the block for the CPU time it took."""
        t0 = time.thread_time()
        try:
            yield
        finally:
            self.pause(time.thread_time() - t0)

    def close(self, out: torch.Tensor, clock: _Clock) -> torch.Tensor:
        """Mark a chunk's output: its backward starts the clock (identity otherwise)."""
        return _Close.apply(out, clock) if out.requires_grad else out

    def open(self, x: torch.Tensor, clock: _Clock) -> torch.Tensor:
        """Mark a chunk's first activation: its backward ends the chunk's backward and sleeps."""
        return _Open.apply(x, clock) if x.requires_grad else x

    def clock(self) -> _Clock:
        return _Clock(self)


class _Clock:
    """One forward's backward timer: the two markers of one chunk call share it."""

    def __init__(self, emulation: Emulation) -> None:
        self.emulation, self.t0 = emulation, None

    def start(self) -> None:
        self.t0 = time.thread_time()

    def stop(self) -> None:
        if self.t0 is not None:
            self.emulation.pause(time.thread_time() - self.t0)
            self.t0 = None


class _Close(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, clock: _Clock) -> torch.Tensor:  # noqa: D102
        ctx.clock = clock
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        ctx.clock.start()
        return grad, None


class _Open(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, clock: _Clock) -> torch.Tensor:  # noqa: D102
        ctx.clock = clock
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        ctx.clock.stop()
        return grad, None
