"""A rank's share of a user's dataset: what `ctx.prepare_data(dataset)` returns.

The same rule as the built-in trainer's batches (sampling.py's `batch_indices`):
optimizer step `s` trains on the global samples `[s*G, (s+1)*G)` of a fixed,
seeded order, `G` the global batch; each rank takes its micro-batches of that
block. What a step trains on is a function of the step alone, so:

- resuming at step `s` (after a crash, from any layout) continues the exact
  sequence: nothing is lost or repeated;
- a resize changes who takes which part of the block, not the block;
- a batch skipped after a numeric fault is skipped by every later run too.

The order is a per-epoch permutation of the dataset's indices drawn from
`(seed, epoch)`, like `SampleOrder`'s windows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kuangchao.workers.data.corpus import check_int
from kuangchao.workers.data.sampling import batch_indices
from kuangchao.workers.errors import DataError


class ItemOrder:
    """Global sample index -> dataset index, in a per-epoch seeded permutation."""

    def __init__(self, n_items: int, seed: int) -> None:
        check_int(seed, "seed", minimum=0)
        if n_items < 1:
            raise DataError("prepare_data: the dataset is empty; give it at least one sample")
        self.n, self.seed = n_items, seed
        self._cached: tuple[int, np.ndarray] = (-1, np.empty(0, dtype=np.int64))

    def __call__(self, g: int) -> int:
        epoch = g // self.n
        cached_epoch, perm = self._cached
        if cached_epoch != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._cached = (epoch, perm)
        return int(perm[g % self.n])


class RankData:
    """This rank's micro-batches of each optimizer step.

    Args:
        dataset: Map-style (`len` and `[i]`), or a `BatchSource` (the job's own data,
            whose samples are already ordered and batched).
        layout: A callable giving the current (dp_rank, dp_size, accum_steps): it
            changes with a resize.
        micro_batch_size: Samples per micro-batch.
        data_index: step -> data index, skipping the batches a numeric fault skipped.
        collate: Turns a list of samples into a batch (default: torch's).
    """

    def __init__(self, dataset: Any, layout: Callable[[], tuple[int, int, int]], micro_batch_size: int,
                 seed: int, data_index: Callable[[int], int],
                 collate: Callable[[list[Any]], Any] | None = None) -> None:
        self.dataset, self.layout, self.micro = dataset, layout, micro_batch_size
        self.data_index = data_index
        self.source = dataset if hasattr(dataset, "order") and hasattr(dataset, "get") else None
        if self.source is None:
            if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
                raise DataError("prepare_data: give a map-style dataset (with len() and [i]), "
                                "e.g. a list or a torch Dataset; iterable datasets have no "
                                "global order to resume in")
            self.order = ItemOrder(len(dataset), seed)
        if collate is None:
            from torch.utils.data import default_collate

            collate = default_collate
        self.collate = collate

    def indices(self, step: int, micro: int) -> range:
        """Global sample indices of this rank's micro-batch `micro` of `step`."""
        dp_rank, dp_size, accum = self.layout()
        return batch_indices(self.data_index(step), micro, dp_rank, dp_size, self.micro, accum)

    def micro_batch(self, step: int, micro: int) -> Any:
        idx = self.indices(step, micro)
        if self.source is not None:
            return self.source.get(idx)
        return self.collate([self.dataset[self.order(g)] for g in idx])

    def step(self, step: int) -> list[Any]:
        """Every micro-batch this rank trains on in optimizer step `step` (0-based)."""
        return [self.micro_batch(step, m) for m in range(self.layout()[2])]

    def __call__(self, step: int) -> Iterator[Any]:
        yield from self.step(step)
