"""Policies by the name the queue table gives (`policy:` in the queues file)."""

from __future__ import annotations

from kuangchao.platform.scheduling.plugins.fifo import FifoPolicy
from kuangchao.platform.scheduling.plugins.gang import GangPolicy
from kuangchao.platform.scheduling.plugins.interface import AdmissionPolicy

POLICIES: dict[str, type] = {"fifo": FifoPolicy, "gang": GangPolicy}


def make_policy(name: str) -> AdmissionPolicy:
    """The policy called `name`.

    Raises:
        ValueError: When no policy has that name; the message lists those that do.
    """
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"scheduler policy {name!r} is unknown; choose one of {sorted(POLICIES)}"
        ) from None
