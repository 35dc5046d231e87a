"""One step's micro-batches through the engine: accumulation, the pipeline schedule,
evaluation, and the compute clock the measured re-balance reads.

Split from engine.py, which wires the layout; these run a step on it. With
uneven data-parallel shares (workers/data/shares.py) each micro-batch's mean loss
is scaled by `len x dp / G` before backward, so the data-parallel average of the
gradients is the global batch's mean, and the rank's loss is its sample-weighted
mean; with even shares both are exactly what they always were (divided by the
number of micro-batches).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from kuangchao.workers.parallel.pipeline import lm_loss

Batch = tuple[torch.Tensor, torch.Tensor]


class ComputeClock:
    """This rank's compute seconds and samples over a step, for the measured re-balance.

    On CPU: the thread's CPU time plus any emulation sleep (waiting for a peer
    costs no CPU time, so communication drops out). On CUDA: events around each
    micro-batch's forward and backward, leaving out the last one when there are
    several (its backward waits for the gradient all-reduce).
    """

    def __init__(self, device: torch.device, emulation: Any) -> None:
        self.cuda = device.type == "cuda"
        self.emulation = emulation
        self.seconds, self.samples = 0.0, 0
        self._events: list[tuple[Any, Any, int]] = []
        self._mark: tuple[float, float] = (0.0, 0.0)

    def _slept(self) -> float:
        return self.emulation.slept if self.emulation is not None else 0.0

    def start(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._events.append((ev, None, 0))
        else:
            self._mark = (time.thread_time(), self._slept())

    def stop(self, samples: int) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._events[-1] = (self._events[-1][0], ev, samples)
            return
        cpu0, slept0 = self._mark
        self.seconds += time.thread_time() - cpu0 + self._slept() - slept0
        self.samples += samples

    def settle(self) -> None:
        """Read the CUDA events (once the step is done)."""
        if not self._events:
            return
        timed = self._events[:-1] if len(self._events) > 1 else self._events
        self._events[-1][1].synchronize()
        self.seconds = sum(a.elapsed_time(b) for a, b, _ in timed) / 1e3
        self.samples = sum(n for _, _, n in timed)
        self._events = []


def accumulate(engine: Any, batches: list[Batch], poison: bool, clock: ComputeClock) -> float:
    """Forward and backward over this rank's micro-batches (DDP, FSDP, manual all-reduce)."""
    module = engine.wrapped[0]
    scales = engine.shares.loss_scales(engine.coords.dp) if engine.shares is not None else None
    emu = engine.emulation
    n, total, weighted = len(batches), 0.0, 0.0
    for i, (x, y) in enumerate(batches):
        last = i == n - 1
        clock.start()
        with engine._no_sync(module, last):
            with engine.precision.autocast(), _timed(emu):
                loss = lm_loss(module(x), y)
            if poison:
                loss = loss * float("nan")
            scaled = loss / n if scales is None else loss * scales[i]
            with _timed(emu):
                engine.precision.scale(scaled).backward()
        clock.stop(len(x))
        value = float(loss.detach())
        total += value
        weighted += value * len(x)
    if scales is None:
        return total / n
    return weighted / max(1, sum(len(x) for x, _ in batches))


def _timed(emu: Any):
    from contextlib import nullcontext

    return emu.timed() if emu is not None else nullcontext()


def run_pipeline(engine: Any, batches: list[Batch], poison: bool, clock: ComputeClock) -> float:
    """One pipeline schedule step over this replica's micro-batches."""
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    losses: list[torch.Tensor] = []
    args = (x,) if engine.holds_first else ()
    kwargs: dict[str, Any] = {"target": y, "losses": losses} if engine.holds_last else {}
    clock.start()
    with engine.precision.autocast():
        engine.schedule.step(*args, **kwargs)
    clock.stop(len(x))
    local = torch.stack(losses).mean().detach().double() if losses else \
        torch.zeros((), dtype=torch.float64)
    if engine.loss_factor != 1.0:  # the schedule's losses carry the replica's weight
        local = local / engine.loss_factor
    if poison:  # the drill: the loss lives inside the schedule, so poison the gradients
        local = local * float("nan")
        for param in engine.holder.parameters():
            if param.grad is not None:
                param.grad.mul_(float("nan"))
    dist.all_reduce(local, group=engine.pp_group)  # only the last stage holds a loss
    return float(local)


def evaluate(engine: Any, batches: list[Batch]) -> float:
    """The mean loss of `batches`, forward only, dropout off; sample-weighted when the
    micro-batches differ in size. With a pipeline, one schedule's worth."""
    for module in engine.wrapped:
        module.eval()
    try:
        with torch.no_grad(), engine.precision.autocast():
            if engine.schedule is None:
                losses = [(float(lm_loss(engine.wrapped[0](x), y)), len(x)) for x, y in batches]
                if len({n for _, n in losses}) == 1:
                    return sum(v for v, _ in losses) / len(losses)
                return sum(v * n for v, n in losses) / max(1, sum(n for _, n in losses))
            out: list[torch.Tensor] = []
            args = (torch.cat([x for x, _ in batches]),) if engine.holds_first else ()
            kwargs: dict[str, Any] = ({"target": torch.cat([y for _, y in batches]),
                                       "losses": out} if engine.holds_last else {})
            engine.schedule.eval(*args, **kwargs)
            local = torch.stack(out).mean().double() if out else \
                torch.zeros((), dtype=torch.float64)
            if engine.loss_factor != 1.0:
                local = local / engine.loss_factor
            dist.all_reduce(local, group=engine.pp_group)  # only the last stage holds a loss
            return float(local)
    finally:
        for module in engine.wrapped:
            module.train()
