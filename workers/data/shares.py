"""Each data-parallel rank's share of a step's block of samples, in proportion to its speed.

A step trains on the block `[s*G, (s+1)*G)` of global samples (sampling.py's
`batch_indices`), `G = micro_batch_size x accum_steps x dp_size`. On mixed
hardware a fast replica takes more of the block than a slow one
(`resources.balance: speed`, workers/parallel/balance.py), so that neither waits
for the other at the gradient all-reduce. The math is unchanged:

- the block is the same, each sample trained once (replica r takes the
  contiguous run `counts[r]` long, after the runs of the replicas before it);
- each micro-batch's mean loss is scaled by `len(micro) x dp / G` before
  backward, so after the data-parallel average of the gradients (DDP, FSDP, the
  manual all-reduce all divide by `dp`) the gradient is the mean over the whole
  global batch, as with an even split;
- the reported loss is the sample-weighted mean (`weight`).

Equal counts are today's even split exactly (`batch_indices`' interleaved
layout, the loss divided by `accum_steps`), so a homogeneous job is unchanged
bit for bit.

How a replica's run is cut into micro-batches (`cut`):

- "own": as few micro-batches of at most `micro_batch_size` as hold it, of
  near-equal sizes (DDP, ZeRO-1, tensor parallelism): replicas may run different
  numbers of micro-batches, since their gradients meet once per step;
- "common": every replica runs the same number (the most any needs), its run cut
  into that many near-equal parts, possibly empty (FSDP2 gathers parameters in
  every micro-batch's forward and backward: the collectives must pair up);
- "units": whole micro-batches of exactly `micro_batch_size` (a pipeline's
  schedule takes micro-batches of one shape); counts are multiples of it.

Pure: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from kuangchao.workers.data.sampling import batch_indices
from kuangchao.workers.errors import DataError

CUTS = ("own", "common", "units")


def split_counts(weights: Sequence[float], total: int, unit: int = 1, minimum: int = 1) -> tuple[int, ...]:
    """Split `total` into parts proportional to `weights` by largest remainder.

    Each part is a multiple of `unit` and at least `minimum` units; the parts sum
    to `total` exactly. Exact arithmetic (fractions), so equal weights give equal
    parts whenever `total` divides evenly, and ties go to the lower index.

    Raises:
        DataError: When `total` is not a multiple of `unit`, a weight is not
            positive, or there are too many parts for `minimum` units each.
    """
    if not weights or any(not (w > 0 and math.isfinite(w)) for w in weights):
        raise DataError(f"speeds must be positive numbers, got {list(weights)}")
    if unit < 1 or total % unit:
        raise DataError(f"{total} samples do not split into units of {unit}")
    units = total // unit
    if minimum * len(weights) > units:
        raise DataError(f"{total} samples cannot give {len(weights)} ranks {minimum * unit} each")
    exact = [Fraction(w) for w in weights]
    whole = sum(exact)
    quota = [units * w / whole for w in exact]
    parts = [max(minimum, math.floor(q)) for q in quota]
    while sum(parts) > units:  # the minimum pushed some up: take from the most over quota
        i = max((i for i in range(len(parts)) if parts[i] > minimum),
                key=lambda i: (parts[i] - quota[i], -i))
        parts[i] -= 1
    while sum(parts) < units:
        i = max(range(len(parts)), key=lambda i: (quota[i] - parts[i], -i))
        parts[i] += 1
    return tuple(p * unit for p in parts)


def near_equal(n: int, k: int) -> list[int]:
    """`n` cut into `k` sizes differing by at most one, the larger first."""
    base, extra = divmod(n, k)
    return [base + 1 if i < extra else base for i in range(k)]


@dataclass(frozen=True)
class Shares:
    """How one step's block splits over the data-parallel ranks.

    Attributes:
        counts: Samples per data-parallel rank; they sum to the global batch.
        micro_batch_size: The most samples one micro-batch holds.
        accum_steps: Micro-batches per rank of the even split.
        cut: How a rank's run is cut into micro-batches ("own", "common", "units").
    """

    counts: tuple[int, ...]
    micro_batch_size: int
    accum_steps: int
    cut: str = "own"

    def __post_init__(self) -> None:
        if self.cut not in CUTS:
            raise DataError(f"unknown micro-batch cut {self.cut!r}; one of {', '.join(CUTS)}")
        want = self.micro_batch_size * self.accum_steps * len(self.counts)
        if sum(self.counts) != want or min(self.counts) < 1:
            raise DataError(f"shares {list(self.counts)} must be >= 1 each and sum to the global "
                            f"batch {want}")
        if self.cut == "units" and any(c % self.micro_batch_size for c in self.counts):
            raise DataError(f"pipeline shares {list(self.counts)} must be whole micro-batches of "
                            f"{self.micro_batch_size}")

    @classmethod
    def even(cls, dp_size: int, micro_batch_size: int, accum_steps: int) -> Shares:
        return cls((micro_batch_size * accum_steps,) * dp_size, micro_batch_size, accum_steps)

    @property
    def dp_size(self) -> int:
        return len(self.counts)

    @property
    def global_batch(self) -> int:
        return sum(self.counts)

    @property
    def is_even(self) -> bool:
        return len(set(self.counts)) == 1

    def sizes(self, dp_rank: int) -> list[int]:
        """The sizes of rank `dp_rank`'s micro-batches, in order."""
        n, mb = self.counts[dp_rank], self.micro_batch_size
        if self.is_even:
            return [mb] * self.accum_steps
        if self.cut == "units":
            return [mb] * (n // mb)
        if self.cut == "common":
            return near_equal(n, max(math.ceil(c / mb) for c in self.counts))
        return near_equal(n, math.ceil(n / mb))

    def spans(self, index: int, dp_rank: int) -> list[range]:
        """Global sample indices of each of rank `dp_rank`'s micro-batches of batch `index`."""
        if self.is_even:
            return [batch_indices(index, m, dp_rank, self.dp_size, self.micro_batch_size,
                                  self.accum_steps) for m in range(self.accum_steps)]
        start = index * self.global_batch + sum(self.counts[:dp_rank])
        out = []
        for size in self.sizes(dp_rank):
            out.append(range(start, start + size))
            start += size
        return out

    def weight(self, dp_rank: int) -> float:
        """What a rank's mean loss is multiplied by so that the plain mean over ranks is
        the global batch's sample-weighted mean (exactly 1.0 when even)."""
        return self.counts[dp_rank] * self.dp_size / self.global_batch

    def loss_scales(self, dp_rank: int) -> list[float] | None:
        """Per micro-batch, what its mean loss is multiplied by before backward so that the
        data-parallel average of the gradients is the global batch's mean; None when even
        (the loss is divided by `accum_steps`, as always)."""
        if self.is_even:
            return None
        return [size * self.dp_size / self.global_batch for size in self.sizes(dp_rank)]

    def describe(self) -> str:
        if self.is_even:
            return f"even: {self.counts[0]} samples per rank"
        sizes = {r: self.sizes(r) for r in range(self.dp_size)}
        return "; ".join(f"rank {r}: {c} samples in {len(sizes[r])} micro-batch(es)"
                         for r, c in enumerate(self.counts))
