"""Exceptions of the control plane.

One base class, one subclass per failure mode. Every exception here survives
pickling, because they cross Ray actor boundaries, and every message says what
was wrong and which setting to change.
"""

from __future__ import annotations


class KuangchaoError(Exception):
    """Base of every error the control plane raises on purpose."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self):  # keeps subclasses with extra state picklable
        return (self.__class__, (self.message,))


class SpecError(KuangchaoError):
    """A job spec is invalid. Carries one `(path, message)` per problem."""

    def __init__(self, errors: list[tuple[str, str]] | str) -> None:
        if isinstance(errors, str):
            errors = [("", errors)]
        self.errors = list(errors)
        lines = [f"{path}: {msg}" if path else msg for path, msg in self.errors]
        super().__init__("\n".join(lines))

    def __reduce__(self):
        return (self.__class__, (self.errors,))


class TopologyError(KuangchaoError):
    """A cluster topology file or node label is malformed."""


class PlacementError(KuangchaoError):
    """No placement satisfies the job's shape on the free capacity."""


class StoreUnavailable(KuangchaoError):
    """Redis cannot be reached or refused the credentials."""


class JobNotFound(KuangchaoError):
    """No job with this id exists in the store."""

    @classmethod
    def for_id(cls, job_id: str) -> JobNotFound:
        return cls(f"no job with id {job_id!r}; `kc list` shows the known jobs")


class InvalidTransition(KuangchaoError):
    """A job state change the state machine forbids."""


class ClusterError(KuangchaoError):
    """The local cluster could not be started, found or stopped."""


class JobFailed(KuangchaoError):
    """A training job failed; the message carries the cause."""
