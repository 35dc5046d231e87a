"""Live resizing inside a training process.

A resize (or the loss of a peer, for an elastic job) moves every rank to the
next *generation* of the job's process group. The controller publishes the
generation in Redis (`kuangchao.platform.protocol.generation`): its number,
world size, accumulation, the rendezvous it hosts, and the new rank of each
current rank that stays. Each rank then:

1. leaves the old group (`rejoin`), keeping its process, its imports, its
   loaded data and its model and optimizer in memory;
2. joins the new group at its new rank, or returns when it is not in it;
3. agrees with the others on whose state is newest and, when any rank lacks
   it (a fresh rank, or a survivor one step behind after a crash mid-step),
   receives it by broadcast (`sync_state`).

Nothing is read back from disk. A rank that died mid-step leaves the
survivors holding the state of the last step any of them completed, which is
a consistent state: a step is applied by a rank only after its all-reduce
completed, and an all-reduce that completed anywhere had every rank's
gradients in it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kuangchao.platform.protocol.generation import Generation
from kuangchao.workers.collectives import permit
from kuangchao.workers.errors import TrainingError

GENERATION_POLL_S = 0.02
# How a broken collective shows itself: gloo raises a plain RuntimeError naming its
# transport; NCCL and the c10d store raise DistError subclasses.
_COLLECTIVE_MARKERS = ("gloo", "Connection closed by peer", "Connection reset", "Broken pipe",
                       "NCCL", "Socket Timeout", "ProcessGroup")


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective broken by a lost peer, not a bug in the train function."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _COLLECTIVE_MARKERS)


def join_generation(gen: Generation, rank: int, timeout_s: float) -> tuple[str, Any]:
    """Join generation `gen` as `rank`: NCCL with CUDA, else gloo.

    Returns the backend and the generation's key-value store (for `mark_ready`).
    """
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(seconds=timeout_s)
    base = dist.TCPStore(gen.host, gen.port, is_master=False, timeout=timeout)
    store = dist.PrefixStore(gen.prefix, base)
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=store, rank=rank, world_size=gen.world_size,
                            timeout=timeout)
    return backend, store


def mark_ready(store: Any, rank: int) -> None:
    """Tell the controller (which hosts the store) that this rank trains in the new generation."""
    store.set(f"ready/{rank}", str(time.time()))


def await_generation(read: Any, after: int, timeout_s: float) -> Generation:
    """Poll `read()` (the published generation document) until one newer than `after` appears.

    Raises:
        TrainingError: When none appears within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            doc = read()
        except Exception:  # Redis away for a moment: keep waiting until the deadline
            doc = None
        if doc and int(doc["gen"]) > after:
            return Generation.from_json(doc)
        if time.monotonic() > deadline:
            raise TrainingError(f"no new process-group generation after {after} within "
                                f"{timeout_s:.0f}s; the controller did not re-form the group")
        time.sleep(GENERATION_POLL_S)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# -- handing the state over ------------------------------------------------------

@dataclass(frozen=True)
class _Slot:
    """Where a tensor sat in a broadcast state: its index, shape, dtype and device."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str


def _strip(obj: Any, out: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        out.append(obj.detach())
        return _Slot(len(out) - 1, tuple(obj.shape), obj.dtype, str(obj.device))
    if isinstance(obj, dict):
        return {k: _strip(v, out) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        items = [_strip(v, out) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def _slots(skeleton: Any, out: list[_Slot]) -> list[_Slot]:
    if isinstance(skeleton, _Slot):
        out.append(skeleton)
    elif isinstance(skeleton, dict):
        for v in skeleton.values():
            _slots(v, out)
    elif isinstance(skeleton, list | tuple):
        for v in skeleton:
            _slots(v, out)
    return out


def _fill(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(skeleton, _Slot):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return {k: _fill(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list | tuple):
        items = [_fill(v, tensors) for v in skeleton]
        return items if isinstance(skeleton, list) else tuple(items)
    return skeleton


def broadcast_state(obj: Any, src: int, device: torch.device) -> Any:
    """Broadcast a nested structure of tensors and plain values from `src` to every rank.

    The structure goes as one pickled object without its tensors; the tensors
    go as one flat buffer per dtype, so a model's state costs a few
    collectives, not one per parameter.
    """
    tensors: list[torch.Tensor] = []
    permit("broadcast")
    meta = [_strip(obj, tensors) if dist.get_rank() == src else None]
    dist.broadcast_object_list(meta, src=src, device=device if device.type == "cuda" else None)
    skeleton = meta[0]
    slots = _slots(skeleton, [])
    received: list[torch.Tensor | None] = [None] * len(slots)
    for dtype in sorted({s.dtype for s in slots}, key=str):
        group = [s for s in slots if s.dtype == dtype]
        sizes = [int(torch.Size(s.shape).numel()) for s in group]
        if dist.get_rank() == src:
            flat = torch.cat([tensors[s.index].reshape(-1).to(device) for s in group])
        else:
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        dist.broadcast(flat, src=src)
        for s, part in zip(group, torch.split(flat, sizes), strict=True):
            received[s.index] = part.view(s.shape).to(s.device).clone()
    if dist.get_rank() == src:
        return obj
    return _fill(skeleton, received)  # type: ignore[arg-type]


def state_source(steps: list[int | None]) -> tuple[int, bool]:
    """Whose state the group continues from, and whether anyone needs it sent.

    Args:
        steps: Each rank's completed step, None for a rank without state.

    Returns:
        The lowest rank holding the newest state, and whether any rank lacks it.

    Raises:
        TrainingError: When no rank holds any state.
    """
    held = [s for s in steps if s is not None]
    if not held:
        raise TrainingError("no rank of the new process group holds the training state")
    best = max(held)
    return steps.index(best), any(s != best for s in steps)


def gather_steps(step: int | None) -> list[int | None]:
    out: list[Any] = [None] * dist.get_world_size()
    permit("all_gather")
    dist.all_gather_object(out, step)
    return out
