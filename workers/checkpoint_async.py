"""Pieces of the asynchronous save: staging to CPU memory, and the handle.

`CheckpointManager.save_async` stages the state (a private CPU copy, so the
optimizer may keep stepping), then writes it on a background thread and hands
back a `PendingCheckpoint`.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from kuangchao.workers.checkpoint_format import CheckpointInfo
from kuangchao.workers.errors import CheckpointError


def stage_to_cpu(obj: Any) -> Any:
    """A deep copy of a (nested) state dict with every tensor copied to CPU.

    The copy never shares storage with the original, even for tensors that are
    already on CPU: the caller's next `optimizer.step()` updates parameters and
    optimizer state in place, and the background write must not see that.
    Non-tensor leaves are deep-copied for the same reason (the trainer mutates
    `param_groups[i]["lr"]` every step). Tensors that alias each other (a
    weight-tied head and embedding) get one shared copy, as in the original.
    """
    return _stage(obj, {})


def _stage(obj: Any, memo: dict[tuple, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        key = _alias_key(obj)
        if key not in memo:
            memo[key] = obj.detach().to("cpu", copy=True)
        return memo[key]
    if isinstance(obj, dict):
        return {k: _stage(v, memo) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_stage(v, memo) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_stage(v, memo) for v in obj)
    return copy.deepcopy(obj)


def _alias_key(t: torch.Tensor) -> tuple:
    """Equal for two tensors that view the same memory the same way."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without plain storage
        return (id(t),)
    return (t.device, ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


class PendingCheckpoint:
    """A checkpoint being written in the background.

    Attributes:
        step, path: The checkpoint it will be once committed.
        blocked_s: Seconds `save_async` held the caller (waiting for the
            previous save, plus staging).
    """

    def __init__(self, step: int, path: str, blocked_s: float) -> None:
        self.step, self.path, self.blocked_s = step, path, blocked_s
        self._future: Future[CheckpointInfo] = Future()

    @classmethod
    def completed(cls, info: CheckpointInfo) -> PendingCheckpoint:
        """A handle for a checkpoint that is already committed."""
        pending = cls(info.step, info.path, info.blocked_s)
        pending._future.set_result(info)
        return pending

    def run(self, write: Callable[[], CheckpointInfo], name: str) -> None:
        """Start `write` on a daemon thread; its result or error lands here.

        Daemon, so that a process that is exiting anyway (a failed rank) is not
        held up by a write no one will wait for; the temporary folder it leaves
        is never mistaken for a checkpoint and is removed by the next commit.
        """
        def target() -> None:
            try:
                self._future.set_result(write())
            except BaseException as exc:  # everything must reach result(), nothing is lost
                self._future.set_exception(exc)

        threading.Thread(target=target, name=name, daemon=True).start()

    def done(self) -> bool:
        return self._future.done()

    def failed(self) -> bool:
        return self._future.done() and self._future.exception() is not None

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        """Wait for the commit.

        Raises:
            CheckpointError: The write failed (the cause is chained), or it
                was still running after `timeout` seconds.
        """
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            raise CheckpointError(f"checkpoint step {self.step} is still being written after "
                                  f"{timeout:.0f}s") from None
        except CheckpointError:
            raise
        except Exception as exc:  # not BaseException: a Ctrl-C while waiting stays a Ctrl-C
            raise CheckpointError(f"checkpoint step {self.step} failed in the background: "
                                  f"{type(exc).__name__}: {exc}") from exc

    def add_done_callback(self, fn: Callable[[PendingCheckpoint], None]) -> None:
        """Call `fn(self)` once the write ends (on the writer thread, or now if it has)."""
        self._future.add_done_callback(lambda _f: fn(self))
