"""Training data for kuangchao workers: sample order and batching.

The pipeline is deliberately index-based so that it survives elastic resizing:

* a corpus is a flat 1-D array of token ids (``load_corpus``, in ``corpus.py``);
* ``SampleOrder`` maps a *global sample index* to a window of the corpus, in a
  per-epoch shuffled order that depends only on the seed;
* ``batch_indices`` says which global samples one data-parallel rank consumes
  in one micro-step. A step always covers the same block of global samples, so
  changing the number of ranks or accumulation steps (with the global batch
  fixed) does not change what the model sees in that step.

This module holds the index logic (``SampleOrder``, ``batch_indices``) and the
batches built from it (``BatchSource``, ``rank_batches``). Reading corpora
lives in ``corpus.py`` and background prefetching in ``prefetch.py``; their
public names are re-exported here, so ``from kuangchao.workers.data.sampling import ...``
keeps working for all of them.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from kuangchao.workers.data.corpus import STDLIB_SKIP_DIRS, check_int, load_corpus, stdlib_corpus
from kuangchao.workers.data.prefetch import Prefetcher
from kuangchao.workers.errors import DataError

__all__ = [
    "STDLIB_SKIP_DIRS",
    "BatchSource",
    "DataError",
    "Prefetcher",
    "SampleOrder",
    "batch_indices",
    "load_corpus",
    "rank_batches",
    "stdlib_corpus",
]


class SampleOrder:
    """Map global sample indices to window start offsets in the corpus.

    The corpus is cut into ``n_windows = (n_tokens - 1) // seq_len`` windows of
    ``seq_len + 1`` tokens starting at multiples of ``seq_len``: the inputs
    ``x = w[:-1]`` of different windows never overlap, and each window borrows
    the next window's first token as its last target. Global sample ``g`` is in
    epoch ``g // n_windows`` and reads window ``perm[g % n_windows]``, where
    ``perm`` is a permutation drawn from ``np.random.default_rng([seed, epoch])``,
    so the order depends on nothing but ``(seed, g)``.

    Args:
        n_tokens: Corpus length in tokens.
        seq_len: Tokens per training sample.
        seed: Non-negative shuffle seed.

    Raises:
        DataError: When the corpus has fewer than ``seq_len + 2`` tokens or an
            argument is out of range.
    """

    def __init__(self, n_tokens: int, seq_len: int, seed: int) -> None:
        check_int(seed, "seed", minimum=0)
        _check_corpus_length(n_tokens, seq_len)
        self.n_tokens = n_tokens
        self.seq_len = seq_len
        self.seed = seed
        self.n_windows = (n_tokens - 1) // seq_len
        # (epoch, permutation) swapped as one tuple so a reader never pairs an
        # epoch with another epoch's permutation.
        self._cached: tuple[int, np.ndarray] = (-1, np.empty(0, dtype=np.int64))

    def epoch_of(self, g: int) -> int:
        """Epoch that global sample ``g`` belongs to."""
        return g // self.n_windows

    def permutation(self, epoch: int) -> np.ndarray:
        """Window order for ``epoch`` (cached for the most recent epoch)."""
        cached_epoch, perm = self._cached
        if cached_epoch != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._cached = (epoch, perm)
        return perm

    def offset(self, g: int) -> int:
        """Start offset in the corpus of the window for global sample ``g``.

        Raises:
            DataError: When ``g`` is negative.
        """
        if g < 0:
            raise DataError(f"global sample index must be >= 0, got {g}")
        window = self.permutation(self.epoch_of(g))[g % self.n_windows]
        return int(window) * self.seq_len


def batch_indices(
    step: int,
    micro_step: int,
    dp_rank: int,
    dp_size: int,
    micro_batch_size: int,
    accum_steps: int,
) -> range:
    """Global sample indices for one rank's micro-batch.

    Optimizer step ``s`` consumes the block ``[s*G, (s+1)*G)`` with
    ``G = micro_batch_size * dp_size * accum_steps``; micro-step ``m`` takes the
    ``m``-th run of ``micro_batch_size * dp_size`` samples and rank ``r`` the
    ``r``-th ``micro_batch_size`` of that run. Over all ``(m, r)`` the block is
    partitioned exactly, so resizing ``dp_size``/``accum_steps`` with ``G``
    fixed leaves each step's set of samples unchanged.

    Args:
        step: Optimizer step, >= 0.
        micro_step: Gradient-accumulation step in ``[0, accum_steps)``.
        dp_rank: Data-parallel rank in ``[0, dp_size)``.
        dp_size: Number of data-parallel ranks.
        micro_batch_size: Samples per rank per micro-step.
        accum_steps: Micro-steps per optimizer step.

    Returns:
        A ``range`` of ``micro_batch_size`` consecutive global sample indices.

    Raises:
        DataError: When an argument is out of range.
    """
    check_int(dp_size, "dp_size", minimum=1)
    check_int(micro_batch_size, "micro_batch_size", minimum=1)
    check_int(accum_steps, "accum_steps", minimum=1)
    check_int(step, "step", minimum=0)
    if not 0 <= micro_step < accum_steps:
        raise DataError(f"micro_step {micro_step} is outside [0, accum_steps={accum_steps})")
    if not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank {dp_rank} is outside [0, dp_size={dp_size})")
    per_micro_step = micro_batch_size * dp_size
    start = step * per_micro_step * accum_steps + micro_step * per_micro_step
    start += dp_rank * micro_batch_size
    return range(start, start + micro_batch_size)


class BatchSource:
    """Materialise (x, y) token batches for global sample indices.

    Args:
        corpus: 1-D array of token ids (array or memmap).
        seq_len: Tokens per sample.
        seed: Shuffle seed for the underlying ``SampleOrder``.

    Raises:
        DataError: When the corpus is not 1-D or too short for ``seq_len``.
    """

    def __init__(self, corpus: np.ndarray, seq_len: int, seed: int) -> None:
        if corpus.ndim != 1:
            raise DataError(f"data: expected a 1-D token array, got shape {corpus.shape}")
        self.corpus = corpus
        self.seq_len = seq_len
        self.order = SampleOrder(len(corpus), seq_len, seed)
        self._span = np.arange(seq_len + 1, dtype=np.int64)

    def get(self, indices: range) -> tuple[torch.Tensor, torch.Tensor]:
        """Return inputs and next-token targets for the given samples.

        Args:
            indices: Global sample indices, e.g. from ``batch_indices``.

        Returns:
            ``(x, y)``, LongTensors of shape ``[len(indices), seq_len]`` with
            ``y[:, t] == x[:, t + 1]`` within a window.
        """
        starts = np.fromiter((self.order.offset(g) for g in indices), dtype=np.int64)
        # One fancy-index gather reads only the needed windows, even from a memmap.
        windows = np.asarray(self.corpus[starts[:, None] + self._span], dtype=np.int64)
        windows = windows.reshape(len(indices), self.seq_len + 1)
        tokens = torch.from_numpy(windows)
        return tokens[:, :-1], tokens[:, 1:]


def rank_batches(
    source: BatchSource,
    start_step: int,
    total_steps: int,
    dp_rank: int,
    dp_size: int,
    micro_batch_size: int,
    accum_steps: int,
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Yield this rank's micro-batches for steps ``[start_step, total_steps)``.

    Args:
        source: Where batches come from.
        start_step: First optimizer step (e.g. the step to resume from).
        total_steps: One past the last optimizer step.
        dp_rank, dp_size, micro_batch_size, accum_steps: See ``batch_indices``.

    Yields:
        ``(step, micro_step, x, y)`` in step-major, micro-step-minor order.
    """
    for step in range(start_step, total_steps):
        for micro_step in range(accum_steps):
            indices = batch_indices(
                step, micro_step, dp_rank, dp_size, micro_batch_size, accum_steps
            )
            x, y = source.get(indices)
            yield step, micro_step, x, y


def _check_corpus_length(n_tokens: int, seq_len: int) -> None:
    check_int(seq_len, "model.seq_len", minimum=1)
    if n_tokens < seq_len + 2:
        raise DataError(
            f"data: the corpus has {n_tokens} tokens, fewer than model.seq_len + 2 = "
            f"{seq_len + 2}; use a larger corpus (data.path, data.max_bytes) or lower "
            f"model.seq_len"
        )
