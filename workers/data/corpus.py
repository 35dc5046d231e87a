"""Training corpora for kuangchao workers: where the token ids come from.

A corpus is a flat 1-D array of token ids. ``load_corpus`` reads one from a
``.bin`` file of uint16 tokens (memory-mapped), a text file or a directory of
text files (read as bytes), or, with no path, builds the built-in corpus: the
Python standard library's own source read as bytes (vocab 256), real text that
exists on every node without a download. ``stdlib_corpus`` caches that build
under ``$XDG_CACHE_HOME/kuangchao``.

``DataError`` and ``check_int`` live here too because every data module
(``sampling.py``, ``prefetch.py``) raises them and this module imports neither.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from kuangchao.platform.security.admission import under
from kuangchao.workers.errors import DataError

STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib"}
)


# In a rank, its token holder's check of the data_loader token (raises PermissionError
# unless it grants dataset_read; workers/runtime/credentials.py). None elsewhere.
_read_guard: Callable[[str], None] | None = None


def set_read_guard(guard: Callable[[str], None] | None) -> None:
    global _read_guard
    _read_guard = guard


def permit_read(what: str) -> None:
    """Ask the rank's data_loader token before reading `what` (a path, or batches)."""
    guard = _read_guard
    if guard is not None:
        guard(what)


def check_int(value: object, name: str, minimum: int) -> None:
    """Raise ``DataError`` unless ``value`` is an integer >= ``minimum``."""
    # numpy integers are accepted: indices often come out of numpy arithmetic.
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise DataError(f"{name}: expected an integer >= {minimum}, got {value!r}")


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


def load_corpus(path: str | None, max_bytes: int, vocab_size: int,
                roots: tuple[str, ...] | None = None) -> np.ndarray:
    """Load the training corpus as a flat array of token ids.

    Args:
        path: ``None`` for the built-in stdlib corpus; a ``.bin`` file of
            nanoGPT-style uint16 tokens (memory-mapped); any other file, read as
            bytes; or a directory, whose regular non-hidden files are read as
            bytes and concatenated in sorted name order.
        max_bytes: Read at most this many bytes from text sources and the
            stdlib, and at most ``max_bytes // 2`` tokens from a ``.bin`` file.
        vocab_size: The model's vocabulary size; every token must be below it.
        roots: The folders jobs may read data from on this node; the path, and
            each file of a folder, must resolve (symlinks followed) inside one.
            None: no check (tools reading a user's own files).

    Returns:
        A 1-D ``uint8`` array (text) or ``uint16`` memmap (``.bin``).

    Raises:
        DataError: When the path is outside the roots, missing, unreadable or
            empty, or a token is ``>= vocab_size``.
        PermissionError: In a rank whose data_loader token does not grant dataset_read.
    """
    _check_max_bytes(max_bytes)
    permit_read(path or "the built-in corpus")
    if path is not None and roots is not None:
        _check_inside(Path(path), roots)
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


def _check_inside(path: Path, roots: tuple[str, ...]) -> None:
    """Refuse a path that resolves outside every root, before anything is opened.

    The API checked the path as written; a symlink under a root can still point
    anywhere, so the worker checks where it leads. Nothing said here depends on
    whether the target exists."""
    real_roots = tuple(os.path.realpath(r) for r in roots)
    targets = [path]
    if path.is_dir() and under(os.path.realpath(path), real_roots):
        targets += [p for p in path.iterdir() if not p.name.startswith(".")]
    for target in targets:
        if not under(os.path.realpath(target), real_roots):
            raise DataError(f"data.path: '{path}' leads outside the folders jobs may read on this "
                            f"node ({', '.join(roots)}); put the data under one of them, or ask "
                            "an operator to add a root (KC_DATA_ROOTS)")


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
