"""Reading one field of a stored spec document without restating the spec's defaults.

Specs are stored resolved (platform/spec/stored.py), so a field is missing only
from a record written before the field existed; its value then is the spec's
own default, read from the pydantic model. Code that wants the whole spec takes
it typed with `stored.spec_of`; this is for the few readers of a single raw
field (the elastic range of a raw document, the API's job views, `kc checkpoint`).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import Any


def value(doc: Mapping[str, Any], section: str, name: str) -> Any:
    """`doc[section][name]`, or the spec's default for it when the record has none."""
    part = doc.get(section)
    if isinstance(part, Mapping) and name in part:
        return part[name]
    return default(section, name)


@cache
def default(section: str, name: str) -> Any:
    """The spec's default for `section.name`.

    Raises:
        KeyError: When the spec has no such field (a typo in the caller).
    """
    # At call time, not import time: jobspec imports the spec modules that read this.
    from kuangchao.platform.spec.jobspec import JobSpec

    model = JobSpec.model_fields[section].annotation
    return model.model_fields[name].get_default(call_default_factory=True)  # type: ignore[union-attr]
