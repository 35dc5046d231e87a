"""Numbers read from the environment, with a message that names the variable.

A bad value (`KC_QUARANTINE_FAILURES=abc`, a negative retention) is the
operator's to fix, so it is a `ClusterError` saying which variable, what it
holds and what it takes: the CLI turns that into exit code 2, never a
traceback. Pure: no Ray, Redis or torch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from kuangchao.platform.errors import ClusterError


def env_number(name: str, default: float, *, integer: bool = False, minimum: float = 0.0,
               environ: Mapping[str, str] | None = None) -> float:
    """`name`'s value as a number (an int when `integer`), `default` when unset or empty.

    Raises:
        ClusterError: The value is not a finite number, not whole where `integer`
            asks for one, or below `minimum`.
    """
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return int(default) if integer else float(default)
    kind = "a whole number" if integer else "a number"
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or (integer and value != int(value)):
        raise ClusterError(f"{name}={raw!r} is not {kind}; set it to {kind} >= {minimum:g} "
                           f"(default {default:g}) or unset it")
    if value < minimum:
        raise ClusterError(f"{name}={raw} is below {minimum:g}; set it to {kind} >= "
                           f"{minimum:g} (default {default:g}) or unset it")
    return int(value) if integer else value
