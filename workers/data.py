"""Training data for kuangchao workers: corpora, sample order and batching.

The pipeline is deliberately index-based so that it survives elastic resizing:

* a corpus is a flat 1-D array of token ids (``load_corpus``);
* ``SampleOrder`` maps a *global sample index* to a window of the corpus, in a
  per-epoch shuffled order that depends only on the seed;
* ``batch_indices`` says which global samples one data-parallel rank consumes
  in one micro-step. A step always covers the same block of global samples, so
  changing the number of ranks or accumulation steps (with the global batch
  fixed) does not change what the model sees in that step.

The built-in corpus is the Python standard library's own source, read as bytes
(vocab 256): real text that exists on every node without a download.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib"}
)


class DataError(ValueError):
    """The training data cannot be used with the configured settings."""


# ---------------------------------------------------------------------------
# Corpora


def stdlib_corpus(max_bytes: int) -> np.ndarray:
    """Return up to ``max_bytes`` bytes of Python standard-library source.

    Files are the ``*.py`` files under the stdlib directory, walked in sorted
    order and skipping ``site-packages``, ``__pycache__`` and test/IDLE trees,
    so the text depends only on the Python install. The result is cached in
    ``$XDG_CACHE_HOME/kuangchao`` (default ``~/.cache/kuangchao``).

    Args:
        max_bytes: Upper bound on the corpus size; the corpus is shorter only if
            the whole stdlib is smaller.

    Returns:
        A 1-D ``uint8`` array of byte values.

    Raises:
        DataError: When ``max_bytes`` is not a positive integer.
    """
    _check_max_bytes(max_bytes)
    cache = _stdlib_cache_path(max_bytes)
    if cache.is_file():
        return np.fromfile(cache, dtype=np.uint8)
    corpus = _build_stdlib_corpus(max_bytes)
    _write_atomically(cache, corpus.tobytes())
    return corpus


def _check_max_bytes(max_bytes: object) -> None:
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise DataError(f"data.max_bytes: expected a positive integer, got {max_bytes!r}")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kuangchao"


def _stdlib_cache_path(max_bytes: int) -> Path:
    version = ".".join(str(v) for v in sys.version_info[:3])
    return _cache_dir() / f"stdlib-py{version}-{max_bytes}.u8"


def _build_stdlib_corpus(max_bytes: int) -> np.ndarray:
    chunks: list[bytes] = []
    total = 0
    for path in _stdlib_sources(sysconfig.get_paths()["stdlib"]):
        data = Path(path).read_bytes()
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks), dtype=np.uint8).copy()


def _stdlib_sources(root: str) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning and sorting in place makes os.walk descend deterministically.
        dirnames[:] = sorted(d for d in dirnames if d not in STDLIB_SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def _write_atomically(path: Path, payload: bytes) -> None:
    """Write ``payload`` to ``path`` so readers never see a partial file.

    Several workers on one node may build the same cache at once; each writes
    its own temp file and ``os.replace`` makes whichever finishes last win with
    identical content. The cache is only an optimisation, so failures (e.g. a
    read-only home directory) are ignored.
    """
    tmp_name = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            dir=path.parent, prefix=f".{path.name}.", delete=False
        ) as f:
            tmp_name = f.name
            f.write(payload)
        os.replace(tmp_name, path)
        tmp_name = None
    except OSError:
        pass
    finally:
        if tmp_name is not None:
            _remove_quietly(tmp_name)


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def load_corpus(path: str | None, max_bytes: int, vocab_size: int) -> np.ndarray:
    """Load the training corpus as a flat array of token ids.

    Args:
        path: ``None`` for the built-in stdlib corpus; a ``.bin`` file of
            nanoGPT-style uint16 tokens (memory-mapped); any other file, read as
            bytes; or a directory, whose regular non-hidden files are read as
            bytes and concatenated in sorted name order.
        max_bytes: Read at most this many bytes from text sources and the
            stdlib, and at most ``max_bytes // 2`` tokens from a ``.bin`` file.
        vocab_size: The model's vocabulary size; every token must be below it.

    Returns:
        A 1-D ``uint8`` array (text) or ``uint16`` memmap (``.bin``).

    Raises:
        DataError: When the path is missing, unreadable or empty, or a token is
            ``>= vocab_size``.
    """
    _check_max_bytes(max_bytes)
    if path is None:
        corpus = stdlib_corpus(max_bytes)
        source = "the built-in stdlib corpus"
    else:
        corpus = _load_path(Path(path), max_bytes)
        source = repr(path)
    if corpus.size == 0:
        raise DataError(
            f"data.path: {source} contains no data; point data.path at a non-empty file"
        )
    _check_vocab(corpus, vocab_size, source)
    return corpus


def _load_path(path: Path, max_bytes: int) -> np.ndarray:
    if not path.exists():
        raise DataError(
            f"data.path: '{path}' does not exist on this node ({socket.gethostname()}); "
            f"put the file where every worker can read it, or omit data.path to use the "
            f"built-in corpus"
        )
    try:
        if path.is_dir():
            return _read_text_dir(path, max_bytes)
        if path.suffix == ".bin":
            return _read_token_file(path, max_bytes)
        return _read_text(path, max_bytes)
    except OSError as exc:
        raise DataError(f"data.path: cannot read '{path}': {exc}") from exc


def _read_token_file(path: Path, max_bytes: int) -> np.ndarray:
    size = path.stat().st_size
    if size == 0:
        return np.zeros(0, dtype=np.uint16)
    if size % 2 != 0:
        raise DataError(
            f"data.path: '{path}' has {size} bytes, not a whole number of uint16 tokens; "
            f"'.bin' files must hold uint16 token ids (rename text files to another suffix)"
        )
    # A memmap keeps multi-GB token files out of RAM; only touched windows are paged in.
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    return tokens[: max_bytes // 2]


def _read_text(path: Path, max_bytes: int) -> np.ndarray:
    with open(path, "rb") as f:
        return np.frombuffer(f.read(max_bytes), dtype=np.uint8).copy()


def _read_text_dir(path: Path, max_bytes: int) -> np.ndarray:
    files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    chunks: list[bytes] = []
    remaining = max_bytes
    for file in files:
        if remaining <= 0:
            break
        with open(file, "rb") as f:
            chunks.append(f.read(remaining))
        remaining -= len(chunks[-1])
    return np.frombuffer(b"".join(chunks), dtype=np.uint8).copy()


def _check_vocab(corpus: np.ndarray, vocab_size: int, source: str) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise DataError(f"model.vocab_size: expected a positive integer, got {vocab_size!r}")
    top = int(corpus.max())
    if top >= vocab_size:
        raise DataError(
            f"model.vocab_size: {source} contains token id {top}, but model.vocab_size is "
            f"{vocab_size}; set model.vocab_size to at least {top + 1}"
        )


# ---------------------------------------------------------------------------
# Sample order and batching


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
        _check_int(seed, "seed", minimum=0)
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
    _check_int(dp_size, "dp_size", minimum=1)
    _check_int(micro_batch_size, "micro_batch_size", minimum=1)
    _check_int(accum_steps, "accum_steps", minimum=1)
    _check_int(step, "step", minimum=0)
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
    _check_int(seq_len, "model.seq_len", minimum=1)
    if n_tokens < seq_len + 2:
        raise DataError(
            f"data: the corpus has {n_tokens} tokens, fewer than model.seq_len + 2 = "
            f"{seq_len + 2}; use a larger corpus (data.path, data.max_bytes) or lower "
            f"model.seq_len"
        )


def _check_int(value: object, name: str, minimum: int) -> None:
    # numpy integers are accepted: indices often come out of numpy arithmetic.
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise DataError(f"{name}: expected an integer >= {minimum}, got {value!r}")


# ---------------------------------------------------------------------------
# Prefetching


class _Failure:
    """Carries an exception raised by the producer across the queue."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = object()
_POLL_S = 0.05


class Prefetcher:
    """Produce items from an iterable in a background thread, ``depth`` ahead.

    Batches are assembled while the model computes on the previous one. An
    exception raised by the iterable is re-raised in the consumer at the
    ``next()`` that would have returned the failed item. ``close()`` returns
    promptly even when the queue is full and nobody is consuming.

    Args:
        iterable: Source of items; its iterator is only touched by the
            background thread.
        depth: Maximum number of items buffered ahead of the consumer.

    Raises:
        DataError: When ``depth`` is not a positive integer.
    """

    def __init__(self, iterable: Iterable[Any], depth: int = 2) -> None:
        _check_int(depth, "prefetch depth", minimum=1)
        self._iterator = iter(iterable)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(
            target=self._produce, name="kuangchao-prefetch", daemon=True
        )
        self._thread.start()

    def _produce(self) -> None:
        try:
            for item in self._iterator:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as exc:  # forwarded to the consumer, whatever it is
            self._put(_Failure(exc))
        finally:
            self._close_iterator()

    def _put(self, item: Any) -> bool:
        # A bounded wait lets the producer notice close() while the queue is full.
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _close_iterator(self) -> None:
        # Runs in the producer thread so a generator's cleanup runs where it ran.
        close = getattr(self._iterator, "close", None)
        if callable(close):
            # A cleanup failure must not mask the error already sent to the consumer.
            with contextlib.suppress(Exception):
                close()

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        item = self._get()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            raise item.exc
        return item

    def _get(self) -> Any:
        while True:
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                # The producer always enqueues _END or a failure before exiting
                # unless close() stopped it; don't wait forever in that case.
                if self._stop.is_set() or (not self._thread.is_alive() and self._queue.empty()):
                    self._done = True
                    return _END

    def close(self, timeout: float = 5.0) -> None:
        """Stop the background thread and drop buffered items.

        Args:
            timeout: Seconds to wait for the thread; it is a daemon, so one
                stuck inside the wrapped iterable cannot keep the process alive.
        """
        self._stop.set()
        self._done = True
        self._drain()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
