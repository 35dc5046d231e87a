"""Unit tests for kuangchao.workers.data.sampling (with its corpus and prefetch modules)."""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kuangchao.workers.data import corpus as corpus_module
from kuangchao.workers.data import prefetch
from kuangchao.workers.data import sampling as data
from kuangchao.workers.data.sampling import (
    BatchSource,
    Prefetcher,
    SampleOrder,
    batch_indices,
    load_corpus,
    rank_batches,
    stdlib_corpus,
)
from kuangchao.workers.errors import DataError

SMALL = 50_000


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "xdg-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


# --- stdlib corpus -------------------------------------------------------------


def test_stdlib_corpus_is_python_source_when_built(cache_home: Path) -> None:
    corpus = stdlib_corpus(SMALL)

    assert corpus.dtype == np.uint8 and corpus.shape == (SMALL,)
    text = corpus.tobytes().decode("utf-8", errors="replace")
    assert "def " in text and "import " in text


def test_stdlib_corpus_is_identical_when_built_twice_without_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a"))
    first = stdlib_corpus(SMALL)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    second = stdlib_corpus(SMALL)

    np.testing.assert_array_equal(first, second)


def test_stdlib_corpus_is_a_prefix_when_max_bytes_is_smaller(cache_home: Path) -> None:
    np.testing.assert_array_equal(stdlib_corpus(1000), stdlib_corpus(SMALL)[:1000])


def test_stdlib_corpus_writes_cache_under_xdg_cache_home_when_built(cache_home: Path) -> None:
    corpus = stdlib_corpus(SMALL)

    files = list((cache_home / "kuangchao").iterdir())
    assert len(files) == 1 and str(SMALL) in files[0].name
    assert files[0].read_bytes() == corpus.tobytes()


def test_stdlib_corpus_reuses_cache_when_called_again(
    cache_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = stdlib_corpus(SMALL)

    def fail(max_bytes: int) -> np.ndarray:
        raise AssertionError("the stdlib was walked again despite a cache")

    monkeypatch.setattr(corpus_module, "_build_stdlib_corpus", fail)
    np.testing.assert_array_equal(stdlib_corpus(SMALL), first)


def test_stdlib_corpus_skips_test_and_site_packages_dirs_when_walking(tmp_path: Path) -> None:
    for rel in ["b.py", "a.py", "pkg/z.py", "test/t.py", "site-packages/s.py", "x.txt"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)

    names = [Path(p).relative_to(tmp_path).as_posix() for p in corpus_module._stdlib_sources(str(tmp_path))]

    assert names == ["a.py", "b.py", "pkg/z.py"]


def test_stdlib_corpus_still_returns_data_when_cache_dir_is_unwritable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))

    assert stdlib_corpus(1000).shape == (1000,)


# --- load_corpus -----------------------------------------------------------------


def test_load_corpus_uses_stdlib_when_path_is_none(cache_home: Path) -> None:
    np.testing.assert_array_equal(load_corpus(None, SMALL, 256), stdlib_corpus(SMALL))


def test_load_corpus_memmaps_uint16_tokens_when_path_ends_in_bin(tmp_path: Path) -> None:
    tokens = np.arange(1000, dtype=np.uint16) * 7
    path = tmp_path / "train.bin"
    tokens.tofile(path)

    corpus = load_corpus(str(path), 10**9, vocab_size=50_304)

    assert isinstance(corpus, np.memmap) and corpus.dtype == np.uint16
    np.testing.assert_array_equal(corpus, tokens)


def test_load_corpus_limits_tokens_when_bin_exceeds_max_bytes(tmp_path: Path) -> None:
    path = tmp_path / "train.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)

    assert len(load_corpus(str(path), 200, vocab_size=1000)) == 100


def test_load_corpus_reads_bytes_when_path_is_a_text_file(tmp_path: Path) -> None:
    path = tmp_path / "input.txt"
    path.write_bytes("hello wörld\n".encode())

    corpus = load_corpus(str(path), 1000, vocab_size=256)

    assert corpus.dtype == np.uint8
    assert corpus.tobytes() == "hello wörld\n".encode()
    assert load_corpus(str(path), 5, vocab_size=256).tobytes() == b"hello"


def test_load_corpus_concatenates_sorted_files_when_path_is_a_directory(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_bytes(b"BBB")
    (tmp_path / "a.txt").write_bytes(b"AAA")
    (tmp_path / ".hidden").write_bytes(b"!!!")
    (tmp_path / "sub").mkdir()

    assert load_corpus(str(tmp_path), 1000, 256).tobytes() == b"AAABBB"
    assert load_corpus(str(tmp_path), 4, 256).tobytes() == b"AAAB"


def test_load_corpus_error_names_path_and_host_when_path_is_missing(tmp_path: Path) -> None:
    missing = tmp_path / "nope.bin"

    with pytest.raises(DataError) as info:
        load_corpus(str(missing), 1000, 256)

    assert str(info.value) == (
        f"data.path: '{missing}' does not exist on this node ({socket.gethostname()}); "
        "put the file where every worker can read it, or omit data.path to use the "
        "built-in corpus"
    )


def test_load_corpus_error_names_vocab_size_when_token_is_too_large(tmp_path: Path) -> None:
    path = tmp_path / "train.bin"
    np.array([1, 2, 300], dtype=np.uint16).tofile(path)

    with pytest.raises(DataError, match=r"model\.vocab_size.*300.*at least 301"):
        load_corpus(str(path), 1000, vocab_size=256)


def test_load_corpus_raises_when_bin_has_odd_byte_count(tmp_path: Path) -> None:
    path = tmp_path / "train.bin"
    path.write_bytes(b"abc")

    with pytest.raises(DataError, match="uint16"):
        load_corpus(str(path), 1000, 256)


def test_load_corpus_raises_when_file_is_empty(tmp_path: Path) -> None:
    path = tmp_path / "empty.txt"
    path.write_bytes(b"")

    with pytest.raises(DataError, match="no data"):
        load_corpus(str(path), 1000, 256)


# --- SampleOrder -------------------------------------------------------------------


def test_sample_order_visits_every_window_once_when_within_an_epoch() -> None:
    order = SampleOrder(n_tokens=1001, seq_len=10, seed=3)

    offsets = [order.offset(g) for g in range(order.n_windows)]

    assert order.n_windows == 100
    assert sorted(offsets) == list(range(0, 1000, 10))
    assert offsets != sorted(offsets)


def test_sample_order_keeps_windows_in_bounds_when_corpus_has_a_ragged_tail() -> None:
    order = SampleOrder(n_tokens=1005, seq_len=10, seed=0)

    assert order.n_windows == 100
    assert max(order.offset(g) for g in range(300)) + 10 + 1 <= 1005


def test_sample_order_is_deterministic_when_seed_is_the_same() -> None:
    a, b = SampleOrder(500, 7, seed=11), SampleOrder(500, 7, seed=11)
    c = SampleOrder(500, 7, seed=12)
    samples = range(0, 3 * a.n_windows, 5)

    assert [a.offset(g) for g in samples] == [b.offset(g) for g in samples]
    assert [a.offset(g) for g in samples] != [c.offset(g) for g in samples]


def test_sample_order_reshuffles_when_epoch_changes() -> None:
    order = SampleOrder(1001, 10, seed=0)
    n = order.n_windows
    epoch0 = [order.offset(g) for g in range(n)]
    epoch1 = [order.offset(g) for g in range(n, 2 * n)]

    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1
    # Jumping back and forth between epochs must not depend on the cache.
    assert order.offset(0) == epoch0[0] and order.offset(n + 1) == epoch1[1]


def test_sample_order_raises_when_corpus_is_shorter_than_seq_len_plus_two() -> None:
    with pytest.raises(DataError, match=r"model\.seq_len"):
        SampleOrder(n_tokens=11, seq_len=10, seed=0)
    SampleOrder(n_tokens=12, seq_len=10, seed=0)


# --- batch_indices -----------------------------------------------------------------


def step_samples(step: int, dp: int, mb: int, accum: int) -> list[int]:
    return [
        g
        for m, r in itertools.product(range(accum), range(dp))
        for g in batch_indices(step, m, r, dp, mb, accum)
    ]


@pytest.mark.parametrize(("dp", "mb", "accum"), [(1, 8, 1), (2, 2, 2), (4, 1, 2), (3, 2, 5)])
def test_batch_indices_partition_the_step_when_all_ranks_and_micro_steps_combine(
    dp: int, mb: int, accum: int
) -> None:
    G = dp * mb * accum
    for step in (0, 1, 17):
        samples = step_samples(step, dp, mb, accum)
        assert sorted(samples) == list(range(step * G, (step + 1) * G))


def test_batch_indices_cover_the_same_set_when_dp_and_accum_change_with_g_fixed() -> None:
    layouts = [(1, 1, 16), (1, 16, 1), (2, 4, 2), (4, 2, 2), (8, 1, 2), (16, 1, 1)]
    for step in (0, 5):
        sets = {frozenset(step_samples(step, dp, mb, accum)) for dp, mb, accum in layouts}
        assert len(sets) == 1


def test_batch_indices_give_each_rank_a_contiguous_slice_when_called() -> None:
    assert batch_indices(3, 1, 2, dp_size=4, micro_batch_size=2, accum_steps=2) == range(
        3 * 16 + 8 + 4, 3 * 16 + 8 + 6
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(micro_step=2, dp_rank=0, dp_size=2, accum_steps=2),
        dict(micro_step=0, dp_rank=2, dp_size=2, accum_steps=2),
        dict(micro_step=0, dp_rank=0, dp_size=0, accum_steps=2),
    ],
)
def test_batch_indices_raise_when_arguments_are_out_of_range(kwargs: dict) -> None:
    with pytest.raises(DataError):
        batch_indices(step=0, micro_batch_size=2, **kwargs)


# --- BatchSource and rank_batches ----------------------------------------------------


def test_batch_source_returns_shifted_windows_when_getting_samples() -> None:
    corpus = np.arange(1001, dtype=np.uint16)
    source = BatchSource(corpus, seq_len=10, seed=0)

    x, y = source.get(range(4, 8))

    assert x.shape == y.shape == (4, 10) and x.dtype == y.dtype == torch.long
    for row, g in enumerate(range(4, 8)):
        start = source.order.offset(g)
        assert x[row].tolist() == list(range(start, start + 10))
        assert y[row].tolist() == list(range(start + 1, start + 11))


def test_batch_source_reads_memmap_when_corpus_is_a_bin_file(tmp_path: Path) -> None:
    path = tmp_path / "train.bin"
    np.arange(2000, dtype=np.uint16).tofile(path)
    source = BatchSource(load_corpus(str(path), 10**6, 4096), seq_len=8, seed=1)

    x, y = source.get(range(3))

    torch.testing.assert_close(x[:, 1:], y[:, :-1])


def test_rank_batches_yield_batch_indices_samples_when_iterated() -> None:
    source = BatchSource(np.arange(5000, dtype=np.uint16), seq_len=8, seed=0)

    got = list(rank_batches(source, 2, 4, dp_rank=1, dp_size=2, micro_batch_size=3, accum_steps=2))

    assert [(s, m) for s, m, _, _ in got] == [(2, 0), (2, 1), (3, 0), (3, 1)]
    for step, micro, x, y in got:
        ex, ey = source.get(batch_indices(step, micro, 1, 2, 3, 2))
        assert torch.equal(x, ex) and torch.equal(y, ey)


# --- Prefetcher ------------------------------------------------------------------------


def test_prefetcher_yields_all_items_in_order_when_iterated() -> None:
    with Prefetcher(range(100), depth=3) as items:
        assert list(items) == list(range(100))


def test_prefetcher_raises_producer_error_when_consumer_reaches_it() -> None:
    def produce() -> Iterator[int]:
        yield 1
        yield 2
        raise RuntimeError("disk on fire")

    prefetcher = Prefetcher(produce())

    assert next(prefetcher) == 1 and next(prefetcher) == 2
    with pytest.raises(RuntimeError, match="disk on fire"):
        next(prefetcher)
    with pytest.raises(StopIteration):
        next(prefetcher)


def test_prefetcher_close_returns_promptly_when_queue_is_full() -> None:
    cleaned_up = threading.Event()

    def endless() -> Iterator[int]:
        try:
            yield from itertools.count()
        finally:
            cleaned_up.set()

    prefetcher = Prefetcher(endless(), depth=1)
    deadline = time.monotonic() + 5
    while not prefetcher._queue.full() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert prefetcher._queue.full()

    started = time.monotonic()
    prefetcher.close()

    assert time.monotonic() - started < 1.0
    assert not prefetcher._thread.is_alive()
    assert cleaned_up.is_set()
    with pytest.raises(StopIteration):
        next(prefetcher)


def test_prefetcher_stays_ahead_when_consumer_is_slow() -> None:
    produced: list[int] = []

    def produce() -> Iterator[int]:
        for i in range(10):
            produced.append(i)
            yield i

    with Prefetcher(produce(), depth=2) as prefetcher:
        assert next(prefetcher) == 0
        deadline = time.monotonic() + 5
        while len(produced) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        # One item handed out, `depth` queued, one more blocked in put().
        assert len(produced) == 4


def test_prefetcher_raises_when_depth_is_not_positive() -> None:
    with pytest.raises(DataError, match="prefetch depth"):
        Prefetcher([], depth=0)


# --- module layout -------------------------------------------------------------------


def test_data_reexports_corpus_and_prefetch_names_when_imported() -> None:
    for name in ("DataError", "load_corpus", "stdlib_corpus", "STDLIB_SKIP_DIRS"):
        assert getattr(data, name) is getattr(corpus_module, name), name
    assert data.Prefetcher is prefetch.Prefetcher
    assert set(data.__all__) <= set(dir(data))


def test_a_path_that_leads_outside_the_roots_is_refused_before_it_is_read(tmp_path: Path) -> None:
    root, outside = tmp_path / "data", tmp_path / "secret"
    root.mkdir()
    outside.mkdir()
    (outside / "credentials").write_bytes(b"api_key = kc_...")
    (root / "ok.txt").write_bytes(b"hello world")
    roots = (str(root),)
    assert corpus_module.load_corpus(str(root / "ok.txt"), 1024, 256, roots=roots).size == 11
    (root / "link").symlink_to(outside / "credentials")  # a symlink under the root
    (root / "folder").mkdir()
    (root / "folder" / "a.txt").write_bytes(b"fine")
    (root / "folder" / "b.txt").symlink_to(outside / "credentials")
    for bad in (outside / "credentials", root / "link", root / "folder", outside / "missing"):
        with pytest.raises(DataError) as info:
            corpus_module.load_corpus(str(bad), 1024, 256, roots=roots)
        assert "leads outside the folders jobs may read" in str(info.value)
        assert "does not exist" not in str(info.value)  # says nothing of what is there
    # Inside the roots a missing file is named as missing.
    with pytest.raises(DataError, match="does not exist"):
        corpus_module.load_corpus(str(root / "missing.bin"), 1024, 256, roots=roots)
