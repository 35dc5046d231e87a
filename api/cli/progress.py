"""Live progress of a job for `kc submit --wait` and `kc train`.

On a terminal one line redraws itself (carriage return, no curses):

    [#####...............] 120/500  loss 2.3412  lr 3.0e-04  12.3k tok/s  mem 1.2 GiB  comm 14%

Elsewhere (a pipe, a file, `ray job logs`) a plain line is printed each time
the step changes, and a line each time the job's state does:

    step 120/500 loss 2.3412 lr 3.0e-04 12.3k tok/s mem 1.2 GiB comm 14%

Everything is built from the job's `progress` (rank 0's last report): `step`,
`total_steps`, `loss`, `lr`, `tokens_per_s`, `mem_bytes` and `comm_share` (a
fraction of the step). A field the report lacks is left out. The functions are
pure; the caller writes what they return.
"""

from __future__ import annotations

import math
from typing import Any

from kuangchao.api.cli.render import one_line

LIVE_STATES = {"RUNNING"}
# States before a job has run: it has no progress to draw yet.
NOT_STARTED = {"QUEUED", "PLACING"}
MIN_BAR, MAX_BAR = 10, 30


def _num(v: Any) -> float | None:
    """A reported number, or None for anything else (missing, a bool, text)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


def _step(progress: dict[str, Any]) -> tuple[int, int | None]:
    step = _num(progress.get("step"))
    total = _num(progress.get("total_steps"))
    return (int(step) if step is not None and math.isfinite(step) else 0,
            int(total) if total is not None and math.isfinite(total) and total > 0 else None)


def _si(v: float) -> str:
    """12345 -> 12.3k; 850 -> 850."""
    for div, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:.1f}{unit}"
    return f"{v:.0f}"


def _bytes(v: float) -> str:
    """1288490188 -> 1.2 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    raise AssertionError("unreachable")


def fields(progress: dict[str, Any]) -> list[str]:
    """The reported metrics, each as `name value`, in a fixed order; missing ones left out."""
    out = []
    loss = _num(progress.get("loss"))
    if loss is not None:
        out.append(f"loss {loss:.4f}")
    lr = _num(progress.get("lr"))
    if lr is not None and math.isfinite(lr):
        out.append(f"lr {lr:.1e}")
    rate = _num(progress.get("tokens_per_s"))
    if rate is not None and math.isfinite(rate):
        out.append(f"{_si(rate)} tok/s")
    mem = _num(progress.get("mem_bytes"))
    if mem is not None and math.isfinite(mem) and mem >= 0:
        out.append(f"mem {_bytes(mem)}")
    comm = _num(progress.get("comm_share"))
    if comm is not None and math.isfinite(comm):
        out.append(f"comm {min(max(comm, 0.0), 1.0) * 100:.0f}%")
    return out


def format_bar(progress: dict[str, Any], width: int = 20) -> str:
    """`[#####...............] 120/500`: `width` cells filled in proportion to
    step/total; all dots and `120/?` while the total is unknown."""
    width = max(1, width)
    step, total = _step(progress)
    filled = min(width, step * width // total) if total else 0
    return f"[{'#' * filled}{'.' * (width - filled)}] {step}/{total or '?'}"


def format_line(progress: dict[str, Any]) -> str:
    """The plain line: `step 120/500 loss 2.3412 lr 3.0e-04 12.3k tok/s ...`."""
    step, total = _step(progress)
    return " ".join([f"step {step}/{total or '?'}", *fields(progress)])


def format_live(progress: dict[str, Any], columns: int = 80, suffix: str = "") -> str:
    """The terminal line, at most `columns - 1` characters: the bar as wide as
    fits (10 to 30 cells), then the metrics, then `suffix`."""
    rest = "".join(f"  {f}" for f in fields(progress)) + suffix
    step, total = _step(progress)
    counter = len(f" {step}/{total or '?'}") + 2  # and the brackets
    width = min(MAX_BAR, max(MIN_BAR, columns - 1 - counter - len(rest)))
    return (format_bar(progress, width) + rest)[:max(1, columns - 1)]


def _state_note(job: dict[str, Any]) -> str:
    note = f"{job.get('id', '?')} {job.get('state', '?')}"
    if job.get("state") == "QUEUED" and job.get("waiting_for"):
        note += f" (waiting: {job['waiting_for']})"
    return note


class ProgressView:
    """What to write to follow one job, poll by poll.

    `frame(job)` returns the text to write now ('' for nothing): on a terminal
    (`live`) the redrawn line, prefixed by a carriage return and an erase;
    otherwise a plain line when the step has changed since the last one shown,
    and a line when the state has. `end()` returns what ends the output (a
    newline under a live line). Job-supplied text is made terminal-safe.
    """

    def __init__(self, live: bool, columns: int = 80) -> None:
        self.live, self.columns = live, max(20, columns)
        self.last_step: int | None = None
        self._last_state: str | None = None
        self._last_line: str | None = None

    def frame(self, job: dict[str, Any]) -> str:
        progress = job.get("progress") or {}
        state = str(job.get("state", "?"))
        step, _ = _step(progress)
        return self._live(job, progress, state, step) if self.live else \
            self._plain(job, progress, state, step)

    def _live(self, job: dict[str, Any], progress: dict[str, Any], state: str, step: int) -> str:
        if state in NOT_STARTED and not step:
            line = one_line(_state_note(job))[:self.columns - 1]
        else:
            suffix = "" if state in LIVE_STATES else f"  {one_line(state)}"
            line = format_live(progress, self.columns, suffix)
        if line == self._last_line:
            return ""
        self._last_line, self.last_step = line, step
        return "\r\033[K" + line

    def _plain(self, job: dict[str, Any], progress: dict[str, Any], state: str, step: int) -> str:
        out = []
        note = _state_note(job)
        if note != self._last_state:
            self._last_state = note
            out.append(one_line(note))
        if step and step != self.last_step:
            self.last_step = step
            out.append(format_line(progress))
        return "".join(line + "\n" for line in out)

    def end(self) -> str:
        return "\n" if self.live and self._last_line is not None else ""
