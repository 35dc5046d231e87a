"""Following a job on the terminal: `kc submit --wait` polls the API, `kc train` reads
the job store beside the driver it runs. The lines themselves are progress.py's.
"""

from __future__ import annotations

import shutil
import sys
import threading
from typing import Any

from kuangchao.api.cli.common import call
from kuangchao.api.cli.progress import ProgressView
from kuangchao.api.sdk.client import Client
from kuangchao.platform.settings import Settings


def progress_view(out: Any) -> ProgressView:
    """A live line when `out` is a terminal, else plain lines."""
    live = out.isatty()
    return ProgressView(live, shutil.get_terminal_size((80, 24)).columns if live else 80)


def follow(c: Client, job_id: str, as_json: bool) -> dict[str, Any]:
    """Poll a job until it ends, showing its progress (on stderr with --json)."""
    out = sys.stderr if as_json else sys.stdout
    view = progress_view(out)

    def show(job: dict[str, Any]) -> None:
        text = view.frame(job)
        if text:
            out.write(text)
            out.flush()

    job = call(c.wait, job_id, on_update=show)
    out.write(view.end())
    out.flush()
    return job


class TrainProgress:
    """Follows the job `kc train` drives, from the job store, on a thread of its
    own: the driver's thread runs the job controller. Best effort: a failed
    read skips a frame, never the job."""

    def __init__(self, out: Any, poll_s: float = 1.0) -> None:
        self.out, self.poll_s = out, poll_s
        self.view = progress_view(out)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, job_id: str) -> None:
        self._thread = threading.Thread(target=self._run, args=(job_id,), daemon=True,
                                        name="kc-train-progress")
        self._thread.start()

    def _run(self, job_id: str) -> None:
        from kuangchao.platform.control import operations as jobs
        from kuangchao.platform.jobs.store import JobStore

        try:
            s = Settings.from_env()
            store = JobStore.from_url(s.redis_url, s.redis_prefix)
        except Exception:
            return
        while not self._stop.is_set():
            try:
                self._write(self.view.frame(jobs.job_view(store, store.get(job_id))))
            except Exception:
                pass
            self._stop.wait(self.poll_s)

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()

    def stop(self, final: dict[str, Any] | None = None) -> None:
        """Stop polling; draw the job as it ended (`final`), then end the line."""
        self._stop.set()
        if self._thread is None:
            return
        self._thread.join(timeout=2)
        if final is not None:
            self._write(self.view.frame(final))
        self._write(self.view.end())
