"""The train loop's part in `kc debug gradient` and `kc profile`: capture at the
agreed step, answer, disarm. A capture that fails is reported, never raised:
a diagnosis must not cost the run."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kuangchao.workers.runtime.debug import gradient_fingerprints, profile_dir, publish_profile

if TYPE_CHECKING:
    from kuangchao.workers.runtime.context import TrainContext


def _answer(ctx: TrainContext, body: dict) -> None:
    cap = ctx.capture
    ctx.capture = None
    if cap is None or ctx.store is None:
        return
    try:
        ctx.store.answer_debug(ctx.job_id, cap.req.id, ctx.rank, {"rank": ctx.rank, **body})
    except Exception as exc:  # noqa: BLE001
        ctx.log(f"could not send the {cap.req.kind} capture: {exc}", level="WARNING")


def gradients(ctx: TrainContext, model: torch.nn.Module, step: int) -> None:
    try:
        body = {"step": step, "params": gradient_fingerprints(model)}
    except Exception as exc:  # noqa: BLE001
        body = {"step": step, "error": f"{type(exc).__name__}: {exc}"}
    _answer(ctx, body)


def profile(ctx: TrainContext, step: int) -> None:
    """Start the profiler before `step` (a loop index) if it is not running yet."""
    cap = ctx.capture
    if cap is None or cap.profiler is not None:
        return
    try:
        cap.start_profile()
        cap.first = step + 1
    except Exception as exc:  # noqa: BLE001
        _answer(ctx, {"error": f"profiler did not start: {exc}"})


def profiled(ctx: TrainContext, last: bool) -> None:
    """After a profiled step: stop once enough steps (or the run's last) were recorded."""
    cap = ctx.capture
    if cap is None or not (cap.profile_done() or last):
        return
    try:
        where = ctx.spec.checkpoint.path
        out = profile_dir(where, ctx.job_id, cap.req.id)
        summary = cap.finish_profile(out, ctx.rank)
        publish_profile(where, ctx.job_id, cap.req.id, out / summary["trace"])
        _answer(ctx, {"first_step": cap.first, "steps": cap.recorded, **summary})
    except Exception as exc:  # noqa: BLE001
        _answer(ctx, {"error": f"profile failed: {type(exc).__name__}: {exc}"})
