"""Background prefetching of training batches for kuangchao workers.

``Prefetcher`` runs any iterable (typically ``data.rank_batches``) in a
daemon thread a few items ahead of the consumer, so batches are assembled
while the model computes. It is a concurrency utility with no knowledge of
corpora or sample order, which is why it sits apart from ``sampling.py``.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterable
from typing import Any

from kuangchao.workers.data.corpus import check_int, permit_read


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

    In a rank, the thread runs in the rank's process, so it shares the rank's
    memory and a token of its own would buy nothing; the rank's data_loader
    token is asked once here, before the thread starts (not per item).

    Raises:
        DataError: When ``depth`` is not a positive integer.
        PermissionError: In a rank whose data_loader token does not grant dataset_read.
    """

    def __init__(self, iterable: Iterable[Any], depth: int = 2) -> None:
        check_int(depth, "prefetch depth", minimum=1)
        permit_read("batches")
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
