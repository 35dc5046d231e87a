"""Exceptions raised inside training processes. Picklable: they cross actors
(`tests/unit/test_errors.py` round-trips each one)."""

from __future__ import annotations

from kuangchao.platform.errors import Picklable


class WorkerError(Picklable, Exception):
    """Base of the errors a worker raises on purpose."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class TrainingError(WorkerError):
    """The train function raised; the message carries the remote traceback."""


class EntrypointError(WorkerError):
    """The user's `module:function` entrypoint could not be imported."""


class CheckpointError(WorkerError):
    """A checkpoint is missing, partial, or fails verification."""


class PlacementMismatch(WorkerError):
    """Ray started a rank on other GPUs than the placement plan chose."""


class Unreachable(WorkerError):
    """A rank cannot reach a part of the control plane (Redis, the Ray head) from its node."""


class FencedError(WorkerError):
    """This process was replaced as its rank and fenced: it may write nothing more
    (workers/fence.py; docs/fault-tolerance.md, 'Fencing')."""


class NumericFault(Picklable, Exception):
    """A step whose gradients cannot be trusted; roll back and skip its batch."""

    def __init__(self, step: int, data_index: int, reason: str) -> None:
        super().__init__(f"step {step + 1} (batch {data_index}): {reason}")
        self.step, self.data_index, self.reason = step, data_index, reason


class ResizeNow(Picklable, Exception):
    """Every rank agreed, at a step boundary, to move to generation `gen`."""

    def __init__(self, gen: int) -> None:
        super().__init__(f"moving to process-group generation {gen}")
        self.gen = gen


class ModelConfigError(Picklable, ValueError):
    """A ``model.*`` setting is invalid or names a model that cannot be built."""


class ModelInputError(Picklable, ValueError):
    """A batch handed to ``forward`` does not fit the model."""


class DataError(Picklable, ValueError):
    """The training data cannot be used with the configured settings."""
