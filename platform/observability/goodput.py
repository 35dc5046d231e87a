"""Goodput: where a job's wall-clock time went, and its effective training time ratio.

ETTR is the share of a job's wall-clock time (submit to end, or to now while it
is live) spent on training steps that are kept. `account` folds timestamped
facts into that split: every second between the job's creation and its end
goes to exactly one place, so productive time plus the causes add up to the
wall-clock time by construction. The causes:

- `startup`: admission to the first step (placing, rank start, restore);
- `checkpoint`: training blocked by checkpoint saves;
- `detection`: from a failure (its estimated moment) until it is declared;
- `recovery`: from the declaration until a step completes again;
- `redone`: steps later rolled back to an older checkpoint, and the step a
  failure interrupted (moved out of productive when the rollback is seen; after
  a live recovery, `Kept`, nothing is redone: that part-step is detection);
- `queueing`: QUEUED, at submit and after a recovery's requeue;
- `preemption`: checkpoint-and-yield, the wait and the restart after a
  scheduler preemption (or a resize by restart);
- `other`: what none of those covers: the tail after the last step (final
  checkpoint verify, teardown), a live resize's pause, and time before the
  oldest kept event of a job whose event list was trimmed.

Facts come in any order; they are sorted by time, and each moves a cursor that
never goes back, so a fact from a skewed clock lands at the cursor instead of
reopening time already accounted. Which stored records feed which fact is
platform/jobs/goodput_facts.py's. Pure: no Redis, Ray or torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

CAUSES = ("startup", "checkpoint", "detection", "recovery", "redone", "queueing", "preemption",
          "other")
TRAINING = "training"
_AFTER_TO_PLACING = {"start": "startup", "failure": "recovery", "preemption": "preemption"}
_TERMINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})


@dataclass(frozen=True)
class State:
    """The job entered state `to` (from `frm`; None for its creation)."""

    ts: float
    to: str
    frm: str | None = None
    order: int = field(default=0, repr=False)


@dataclass(frozen=True)
class Failure:
    """A failure: `ts` is its estimated moment, `declared_at` when the controller declared it."""

    ts: float
    declared_at: float
    order: int = field(default=1, repr=False)


@dataclass(frozen=True)
class Stall:
    """Training was blocked for `seconds`, ending at `ts` (a checkpoint save: `checkpoint`)."""

    ts: float
    seconds: float
    cause: str = "checkpoint"
    order: int = field(default=2, repr=False)


@dataclass(frozen=True)
class Step:
    """Rank 0 completed optimizer step `step` at `ts`. `checkpoint`: known only from a
    checkpoint of that step, which never starts a run by itself."""

    ts: float
    step: int
    checkpoint: bool = False
    order: int = field(default=3, repr=False)


@dataclass(frozen=True)
class Kept:
    """The survivors of the failure declared at `ts` kept their state: no step is redone."""

    ts: float
    order: int = field(default=1, repr=False)


@dataclass(frozen=True)
class _Declared:
    ts: float
    order: int = 1


Fact = State | Failure | Stall | Step | Kept


@dataclass
class Goodput:
    """The split of one job's wall-clock time (`to_json` is the job JSON's `goodput`)."""

    start: float
    end: float
    productive_s: float
    by_cause: dict[str, float]
    open_cause: str | None  # what the time after `end` counts as while the job is live
    reason: str | None = None

    @property
    def wall_s(self) -> float:
        return max(0.0, self.end - self.start)

    @property
    def ettr(self) -> float | None:
        return min(1.0, max(0.0, self.productive_s / self.wall_s)) if self.wall_s > 0 else None

    def extended(self, now: float) -> Goodput:
        """The same split at `now`, the time since `end` added to the open cause (a live job's
        cached split stays whole between recomputes)."""
        if self.open_cause is None or now <= self.end:
            return self
        by = dict(self.by_cause)
        productive = self.productive_s
        if self.open_cause == "productive":
            productive += now - self.end
        else:
            by[self.open_cause] = by.get(self.open_cause, 0.0) + now - self.end
        return Goodput(self.start, now, productive, by, self.open_cause, self.reason)

    def to_json(self) -> dict[str, Any]:
        ettr = self.ettr
        return {"wall_s": round(self.wall_s, 3), "ettr": None if ettr is None else round(ettr, 5),
                "productive_s": round(self.productive_s, 3),
                "by_cause": {c: round(self.by_cause.get(c, 0.0), 3) for c in CAUSES},
                "lost_s": round(sum(self.by_cause.values()), 3),
                "since": self.start, "as_of": self.end, "live": self.open_cause is not None,
                "open_cause": self.open_cause, "reason": self.reason}


def account(start: float, end: float, facts: Iterable[Fact], live: bool,
            reason: str | None = None) -> Goodput:
    """Split `[start, end]` by cause.

    Args:
        start: The job's creation.
        end: Its end (`finished_at`), or now for a live job.
        facts: What is known, in any order; facts after `end` are dropped.
        live: Whether the job is still going (its open interval then has a cause).
        reason: Why part of the split is uncertain, carried to the result.
    """
    end = max(start, end)
    expanded: list[Any] = []
    for f in facts:
        expanded.append(f)
        if isinstance(f, Failure):
            expanded.append(_Declared(max(f.ts, f.declared_at)))
    sweep = _Sweep(start)
    for f in _chained(sorted(expanded, key=lambda f: (f.ts, f.order))):
        if f.ts > end:
            break
        sweep.apply(f)
    return sweep.finish(end, live, reason)


def _chained(facts: list[Any]) -> list[Any]:
    """State changes with the same timestamp in the order they chain (`a -> b`, then
    `b -> c`), whatever order they came in; the creation first."""
    out: list[Any] = []
    i = 0
    while i < len(facts):
        j = i
        while j < len(facts) and facts[j].ts == facts[i].ts and facts[j].order == facts[i].order:
            j += 1
        group = facts[i:j]
        if len(group) > 1 and isinstance(group[0], State):
            targets = {g.to for g in group}
            first = next((g for g in group if g.frm is None or g.frm not in targets), group[0])
            chain = [first]
            rest = [g for g in group if g is not first]
            while rest:
                nxt = next((g for g in rest if g.frm == chain[-1].to), rest[0])
                chain.append(nxt)
                rest.remove(nxt)
            group = chain
        out += group
        i = j
    return out


def total(splits: Iterable[Goodput]) -> dict[str, Any]:
    """Many jobs' splits summed; the ETTR is time-weighted (productive over wall, summed)."""
    wall = productive = 0.0
    by = dict.fromkeys(CAUSES, 0.0)
    n = 0
    for g in splits:
        n += 1
        wall += g.wall_s
        productive += g.productive_s
        for c in CAUSES:
            by[c] += g.by_cause.get(c, 0.0)
    return {"jobs": n, "wall_s": round(wall, 3), "productive_s": round(productive, 3),
            "ettr": round(productive / wall, 5) if wall > 0 else None,
            "by_cause": {c: round(v, 3) for c, v in by.items()}}


class _Sweep:
    """The fold: one pass over time-ordered facts.

    `mode` is what the time since `cursor` counts as: a cause, or `training`,
    whose seconds (`open_s`) become a productive chunk at the next step. Chunks
    remember their step range so that a rollback to step N can move the part
    beyond N to `redone`.
    """

    def __init__(self, start: float) -> None:
        self.start = self.cursor = start
        self.mode = "other"  # until the creation event says otherwise (trimmed events)
        self.after = "start"  # what the next placement resumes from: start, failure, preemption
        self.queued = False
        self.ended = False
        self.totals = dict.fromkeys(CAUSES, 0.0)
        self.chunks: list[list[float]] = []  # [first step (exclusive), last step, seconds]
        self.last = 0.0  # the newest step of the current run
        self.open_s = 0.0
        self.rate: float | None = None  # seconds per step, last measured
        self.first: tuple[str, float, int] | None = None  # a run's first step, not yet timed
        self.stretch = 0.0  # seconds in the current (non-training) mode since it was entered
        self.tail: list[float] | None = None  # a failed run's last stretch, its steps estimated
        self.kept = False  # the survivors of the last failure kept their work (`Kept`)

    def _advance(self, ts: float) -> None:
        dt = max(0.0, ts - self.cursor)
        self.cursor = max(self.cursor, ts)
        if self.mode == TRAINING:
            self.open_s += dt
        else:
            self.totals[self.mode] += dt
            self.stretch += dt

    def _to(self, mode: str) -> None:
        if mode != self.mode:
            self.mode, self.stretch = mode, 0.0

    def apply(self, f: Any) -> None:
        self._advance(f.ts)
        if self.ended:
            return
        if isinstance(f, State):
            self._state(f)
        elif isinstance(f, Failure):
            self._fault()
        elif isinstance(f, _Declared):
            if self.mode == "detection":
                self._to("recovery")
                self.after = "failure"
        elif isinstance(f, Kept):
            self.kept = True
        elif isinstance(f, Stall):
            if self.mode == TRAINING and f.seconds > 0:
                took = min(f.seconds, self.open_s)
                self.open_s -= took
                self.totals[f.cause if f.cause in self.totals else "other"] += took
        elif isinstance(f, Step):
            self._step(f)

    def _step(self, f: Step) -> None:
        if self.queued:
            return  # a late report of a run that already ended: its time is accounted
        if self.mode == "detection" and f.step > self.last:
            # Training went on past the failure's estimated moment (a skewed clock, or a
            # beat older than the step): the time since the estimate was a step's.
            late = min(self.stretch, self.totals["detection"])
            self.totals["detection"] -= late
            self.stretch = 0.0
            if self.tail is not None:  # the run's last stretch held steps up to this one
                self.tail[1], self.tail[2] = float(f.step), self.tail[2] + late
                self.tail = None
            else:
                self._chunk(self.last, f.step, late)
            self.last = float(f.step)
            return
        if self.mode == TRAINING:
            if f.step < self.last and not f.checkpoint:
                # A restore the record did not otherwise show. (A checkpoint's step can
                # land after a later logged step: its time is estimated from the commit.)
                self._rollback(f.step - 1)
            if f.step > self.last:
                secs, self.open_s = self.open_s, 0.0
                self._chunk(self.last, f.step, secs)
                if secs > 0:
                    self.rate = secs / (f.step - self.last)
                self._time_first()
                self.last = float(f.step)
            return
        if f.checkpoint or self.mode == "detection":
            return
        # The first step of a run: the time before it was start-up, recovery or preemption,
        # and the run restored the checkpoint of the step before it (or, `Kept`, went on).
        self._rollback(f.step - 1, "detection" if self.kept else "redone")
        self.kept = False
        self.tail = None
        self.first = (self.mode, self.stretch, f.step)
        self._to(TRAINING)
        self.last, self.open_s = float(f.step), 0.0

    def _fault(self) -> None:
        self.kept = False
        if self.mode == TRAINING:
            self._end_run(None)
        self._to("detection")

    def _state(self, f: State) -> None:
        to = f.to
        if to == "QUEUED":
            preempted = self.mode == TRAINING or (
                f.frm in ("RUNNING", "RESIZING") and self.after != "failure")
            if self.mode == TRAINING:
                self._end_run("preemption")
            self.queued = True
            if f.frm is None:
                self.after = "start"
            elif preempted:
                self.after = "preemption"
            self._to("preemption" if self.after == "preemption" else "queueing")
            return
        self.queued = False
        if to in _TERMINAL:
            if self.mode == TRAINING:
                self._end_run("other")
            self._to("other")  # until `end` (finished_at), should the two differ
            self.ended = True
        elif to == "PLACING":
            if self.mode == TRAINING:
                self._end_run("other")
            self._to(_AFTER_TO_PLACING.get(self.after, "startup"))
        elif to == "RECOVERING":
            if self.mode == TRAINING:  # no failure fact came with it (an older record)
                self._end_run(None)
            if self.mode != "detection":
                self._to("recovery")
                self.after = "failure"
        elif self.mode == "other" and to in ("RUNNING", "RESIZING"):
            self._to("startup")  # trimmed events: the run had begun before the oldest kept

    def _end_run(self, cause: str | None) -> None:
        """Close a run's open training time: to `cause`, or (None: a failure) as a chunk of
        the steps it likely covered, which a rollback then finds."""
        self._time_first()
        if cause is not None:
            self.totals[cause] += self.open_s
        elif self.open_s > 0:
            steps = self.open_s / self.rate if self.rate else math.inf
            self._chunk(self.last, self.last + steps, self.open_s)
            self.tail = self.chunks[-1]
        self.open_s = 0.0

    def _chunk(self, lo: float, hi: float, secs: float) -> None:
        if secs > 0:
            self.chunks.append([lo, hi, secs])

    def _time_first(self) -> None:
        """A run's first step was counted with what came before it; once a step time is
        known, that much of it moves to productive."""
        if self.first is None or not self.rate:
            return
        cause, before, step = self.first
        self.first = None
        moved = min(self.rate, before, self.totals[cause])
        self.totals[cause] -= moved
        self._chunk(step - 1, step, moved)

    def _rollback(self, to_step: float, cause: str = "redone") -> None:
        """Training went back to after step `to_step`: what was spent beyond it is `cause`."""
        kept = []
        for chunk in self.chunks:
            lo, hi, secs = chunk
            if hi <= to_step:
                kept.append(chunk)
                continue
            share = 1.0 if lo >= to_step or math.isinf(hi) else (hi - to_step) / (hi - lo)
            self.totals[cause] += secs * share
            if share < 1.0:
                kept.append([lo, to_step, secs * (1.0 - share)])
        self.chunks = kept
        self.last = min(self.last, max(0.0, to_step))

    def finish(self, end: float, live: bool, reason: str | None) -> Goodput:
        self._advance(end)
        if self.mode == TRAINING:
            self._time_first()
            self._chunk(self.last, self.last, self.open_s)  # in progress: productive so far
            self.open_s = 0.0
        self._time_first()
        open_cause = None
        if live and not self.ended:
            open_cause = "productive" if self.mode == TRAINING else self.mode
        productive = sum(c[2] for c in self.chunks)
        return Goodput(self.start, end, productive, dict(self.totals), open_cause, reason)
