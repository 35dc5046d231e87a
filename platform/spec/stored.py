"""A job's spec as its record stores it, and read back as a typed `JobSpec`.

Submission stores `stored_form(spec)`: the validated spec dumped with every
default filled in, so a record says on its own what the job runs with.
Readers take the typed spec back with `spec_of(job.spec)`, never a raw field
with a default restated next to it: defaults live in the spec package alone.

The migration for records written by older versions: a field added to the
spec since is missing from the stored document, and pydantic fills in its
default; a field the spec has dropped since is left out, with a warning. The
cross-field rules of `validate_spec` are not run again: the job passed them
when it was submitted, and a rule tightened later must not make a stored job
unreadable.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from kuangchao.platform.errors import SpecError
from kuangchao.platform.spec.jobspec import JobSpec, pydantic_errors

log = logging.getLogger(__name__)


def stored_form(spec: JobSpec) -> dict[str, Any]:
    """What a job record holds: the validated spec with every default filled in."""
    return spec.model_dump(mode="json")


def spec_of(doc: Mapping[str, Any]) -> JobSpec:
    """The typed spec of a stored spec document (a `JobRecord.spec`).

    Raises:
        SpecError: When a stored value is of a type or range the spec no longer
            accepts; one entry per field, prefixed `stored spec: `.
    """
    try:
        return JobSpec.model_validate(doc)
    except ValidationError as exc:
        dropped = [e["loc"] for e in exc.errors() if e["type"] == "extra_forbidden"]
        if not dropped or len(dropped) < len(exc.errors()):
            raise SpecError(pydantic_errors(exc, prefix="stored spec: ")) from None
    log.warning("a stored spec holds fields this version does not know, read without them: %s",
                ", ".join(".".join(map(str, loc)) for loc in dropped))
    return JobSpec.model_validate(_without(doc, dropped))


def _without(doc: Mapping[str, Any], paths: list[tuple[Any, ...]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: dict(v) if isinstance(v, Mapping) else v for k, v in doc.items()}
    for path in paths:
        parent: Any = out
        for part in path[:-1]:
            parent = parent[part]
        parent.pop(path[-1], None)
    return out
