"""Numeric faults: a NaN or Inf loss, or a gradient norm that spikes.

Large runs roll back by hand when the loss blows up: restore the last good
checkpoint, skip the batch that did it, go on. The trainer does it by itself.

The check looks at the gradient norm after the all-reduce, so every
data-parallel rank sees the same number and reaches the same verdict at the
same step without another collective. A NaN loss on any rank makes the
reduced gradients NaN, so it is caught the same way.

Skipping is by global data index: optimizer step `s` normally trains on batch
`s`; after batch `k` is skipped, every step from there on trains on the next
index, so the sample sequence stays deterministic across restarts.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from typing import Any


def data_index(step: int, skipped: Iterable[int]) -> int:
    """The batch index optimizer step `step` trains on, given the skipped batches."""
    index = step
    for k in sorted(set(skipped)):
        if k <= index:
            index += 1
    return index


class GradNormGuard:
    """Flags non-finite gradient norms and spikes above `factor` times the running median.

    Spikes are judged only once `window` healthy norms have been seen, so the
    noisy first steps of training do not trip it.
    """

    def __init__(self, factor: float, window: int) -> None:
        self.factor = factor
        self.norms: deque[float] = deque(maxlen=window)

    def check(self, norm: float) -> str | None:
        """Return why `norm` is bad, or None (and remember it) when it is fine."""
        if not math.isfinite(norm):
            return f"gradient norm is {norm} (NaN or Inf loss)"
        if len(self.norms) == self.norms.maxlen:
            median = statistics.median(self.norms)
            if median > 0 and norm > self.factor * median:
                return (f"gradient norm {norm:.4g} is over {self.factor:g}x its running median "
                        f"{median:.4g}")
        self.norms.append(norm)
        return None

    def state(self) -> list[float]:
        return list(self.norms)

    def load_state(self, norms: list[float] | None) -> None:
        self.norms.clear()
        self.norms.extend(norms or [])


def data_position(step: int, skipped: Iterable[int]) -> dict[str, Any]:
    """What a checkpoint records about where the data stream stands."""
    skipped = sorted(set(skipped))
    return {"step": step, "next_batch": data_index(step, skipped), "skipped_batches": skipped}
