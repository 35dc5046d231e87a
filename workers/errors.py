"""Exceptions raised inside training processes. Picklable: they cross actors."""

from __future__ import annotations


class WorkerError(Exception):
    """Base of the errors a worker raises on purpose."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self):
        return (self.__class__, (self.message,))


class TrainingError(WorkerError):
    """The train function raised; the message carries the remote traceback."""


class EntrypointError(WorkerError):
    """The user's `module:function` entrypoint could not be imported."""


class CheckpointError(WorkerError):
    """A checkpoint is missing, partial, or fails verification."""


class PlacementMismatch(WorkerError):
    """Ray started a rank on other GPUs than the placement plan chose."""
