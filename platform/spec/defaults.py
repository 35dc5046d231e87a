"""Reading a stored spec document without restating the spec's defaults.

Specs are stored resolved (`JobSpec.model_dump` at submission), so a field is
missing only from a record written before the field existed. Its value then is
the spec's own default, read from the pydantic model: defaults live in the spec
package alone, and code that reads raw spec documents (the scheduler's policies,
the orphan check, `kc checkpoint`) never repeats them.
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
