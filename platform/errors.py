"""Exceptions of the control plane.

One base class, one subclass per failure mode. Every exception here survives
pickling, because they cross Ray actor boundaries (`tests/unit/test_errors.py`
round-trips each one), and every message says what was wrong and which setting
to change.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kuangchao.platform.execution.recovery import Failure


def _rebuild(cls: type, args: tuple, kwargs: dict[str, Any]) -> BaseException:
    return cls(*args, **kwargs)


class Picklable:
    """Pickles an exception from the arguments it was built with.

    `BaseException` pickles from `self.args`, which is what the class passed to
    `super().__init__`: a subclass that takes other arguments (a `Failure`, a
    reason and a message) cannot be rebuilt from it. Each subclass's `__init__`
    records the arguments of the outermost call instead (not `__new__`: OSError's
    would read them as errno and strerror), and the pickle keeps them and the
    attributes set after construction."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return

        @functools.wraps(init)
        def recording_init(self: Any, *args: Any, **kw: Any) -> None:
            if "_init_args" not in self.__dict__:  # the outermost __init__ is the constructor
                self._init_args = (args, kw)
            init(self, *args, **kw)

        cls.__init__ = recording_init  # type: ignore[method-assign]

    def __reduce__(self):
        args, kwargs = self.__dict__.get("_init_args", (getattr(self, "args", ()), {}))
        state = {k: v for k, v in self.__dict__.items() if k != "_init_args"}
        return (_rebuild, (self.__class__, args, kwargs), state)


class KuangchaoError(Picklable, Exception):
    """Base of every error the control plane raises on purpose."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class SpecError(KuangchaoError):
    """A job spec is invalid. Carries one `(path, message)` per problem."""

    def __init__(self, errors: list[tuple[str, str]] | str) -> None:
        if isinstance(errors, str):
            errors = [("", errors)]
        self.errors = list(errors)
        lines = [f"{path}: {msg}" if path else msg for path, msg in self.errors]
        super().__init__("\n".join(lines))


class AdmissionRefused(SpecError):
    """The submitter's role or tenant may not ask for what a valid spec asks for
    (platform/security/admission.py); the API answers 403."""


class TopologyError(KuangchaoError):
    """A cluster topology file or node label is malformed."""


class PlacementError(KuangchaoError):
    """No placement satisfies the job's shape on the free capacity."""


class StoreUnavailable(KuangchaoError):
    """Redis cannot be reached or refused the credentials."""


class StorageError(KuangchaoError):
    """An object store (s3:// and other fsspec URLs) cannot be used: an unknown scheme,
    a missing bucket, missing or wrong credentials, or a store that stopped answering."""


class JobNotFound(KuangchaoError):
    """No job with this id exists in the store."""

    @classmethod
    def for_id(cls, job_id: str) -> JobNotFound:
        return cls(f"no job with id {job_id!r}; `kc list` shows the known jobs")


class InvalidTransition(KuangchaoError):
    """A job state change the state machine forbids."""


class ClusterError(KuangchaoError):
    """The local cluster could not be started, found or stopped."""


class WatchEnded(ClusterError):
    """The watch lost Ray after the control plane was up (not a configuration error)."""


class JobFailed(KuangchaoError):
    """A training job failed; the message carries the cause."""


class Cancelled(KuangchaoError):
    """The job was cancelled while the controller was working on it."""


class Preempted(KuangchaoError):
    """The scheduler took the job's GPUs back; it goes back to the queue."""


class WorkerLost(KuangchaoError):
    """A rank died, hung or lost its node: an infrastructure fault the job recovers from."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class RankFailed(KuangchaoError):
    """A rank's train function raised, or a call to the job's ranks failed; the
    message is the rank's error without Ray's wrapping."""


class GaveUp(KuangchaoError):
    """The failure used up `max_restarts`; the job is already FAILED."""


class FinishedDuringResize(Picklable, Exception):
    """The ranks finished the job's last step instead of moving to the new generation."""


class CopyRefused(KuangchaoError):
    """A keeper refused a rank's peer-memory copy (platform/protocol/memory_copies.py).
    `reason` is one of: too_large, checksum, malformed. The rank logs it and the job
    relies on its disk checkpoints for that step."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class TokenError(Picklable, PermissionError):
    """A token was refused. `reason` is one of: missing, malformed, expired,
    tampered, revoked, denied."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message


class DriverStopped(Picklable, BaseException):
    """SIGTERM or SIGHUP reached the driver: `ray job stop`, or the pod going away.

    A BaseException, like KeyboardInterrupt, so that no `except Exception` on the
    way up swallows it; the controller's `finally` tears the workers down."""
