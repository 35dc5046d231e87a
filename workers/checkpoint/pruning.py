"""Pruning a job's checkpoint folder: retiring what is beyond `keep_last` at each
commit and deleting it off the critical path, while keeping away from the
checkpoints being read.

Split from manager.py, which calls `prune` after each commit and `reading_from`
around each verification and load.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

from kuangchao.workers.checkpoint.files import retire, retire_leftovers, start_reaper


class Pruner:
    """The thread deleting retired checkpoints, and the folders being read (verified
    or loaded), which are never retired."""

    def __init__(self) -> None:
        self.reaper: threading.Thread | None = None
        self._lock = threading.Lock()
        self._reading: dict[Path, int] = {}

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the last deletion is over; False on timeout."""
        reaper = self.reaper
        if reaper is not None:
            reaper.join(timeout)
            if reaper.is_alive():
                return False
        return True

    def prune(self, folder: Path, committed: list[Path], keep_last: int, keep: Path) -> None:
        """Retire the checkpoints of `committed` (oldest first) beyond `keep_last`, and
        stale temporary folders of `folder`.

        Each is renamed at once to a hidden name never used again, so that no
        listing shows it and no save writes into it; a background thread then
        deletes those names only, so the next save's commit never races with
        it. `keep` (just committed: the newest verified checkpoint) and
        checkpoints being verified or loaded are never retired.
        """
        self.wait()  # the previous deletion; long done in any real training loop
        self.reaper = None
        with self._lock:
            reading = set(self._reading)
            old = [p for p in committed[:-keep_last] if p != keep and p.resolve() not in reading]
            for path in old:
                with contextlib.suppress(OSError):  # gone already: nothing to do
                    retire(path)
        # Only one save is ever in flight, and it has just been renamed, so no
        # temporary folder left is live.
        doomed = retire_leftovers(folder)
        if doomed:
            self.reaper = start_reaper(doomed)

    @contextlib.contextmanager
    def reading_from(self, path: Path) -> Iterator[None]:
        """Keep pruning away from `path` meanwhile."""
        key = Path(path).resolve()
        with self._lock:
            self._reading[key] = self._reading.get(key, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._reading[key] -= 1
                if not self._reading[key]:
                    del self._reading[key]
