"""The controller claim on a job (`job:{id}:controller`): `name/pid` of the controller
running it, or `name/launching` while the scheduler starts that controller.

A restarted controller actor keeps its name but not its pid, which is how it
tells that an earlier run of itself died mid-job; the orphan check reads the
name to find the actor. Pure.
"""

from __future__ import annotations

LAUNCHING = "launching"  # the pid part of a controller claim made before it starts


def claim(name: str, pid: int | str) -> str:
    return f"{name}/{pid}"


def controller_name(ident: str | None) -> str | None:
    """The actor name in a controller claim `name/pid`."""
    return ident.rsplit("/", 1)[0] if ident else None
