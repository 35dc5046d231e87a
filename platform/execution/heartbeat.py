"""Rank heartbeats as the controller reads and judges them.

The record itself, one Redis key per rank with a TTL of `heartbeat_timeout_s`,
is the protocol's (`kuangchao.platform.protocol.heartbeat.Beat`): the ranks
write it, and the store (`platform/jobs/beats.py`) reads every rank's in one round trip.

`Classifier` is pure: the controller feeds it what it read and the time, and
it answers which ranks are dead (heartbeat gone) or hung (heartbeat alive,
no progress for `hang_timeout_s`). After the store was unreachable it holds
its verdicts for a grace period, so a Redis restart does not look like every
rank dying at once.

A beat counts only from the process placed at its rank (`pids`) and never from
a fenced one (`fenced`, platform/jobs/fences.py): a rank replaced while its node
was cut off may beat again under its old number once the network heals, and
must neither keep its successor alive in the controller's eyes nor hide its
successor's silence. (Progress and loss points are not the controller's to
drop: a rank writes them in the same pipeline as its beat, and the rank's own
lease, workers/fence.py, is what keeps a stale one from sending them.)
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kuangchao.platform.jobs.fences import member
from kuangchao.platform.protocol.heartbeat import Beat

# Before the first step (imports, restore, compile) and after its train
# function returned, a rank is judged only by whether it beats: how long
# start-up takes, or how long its peers still work, is the model's business.
UNTIMED_PHASES = frozenset({"init", "done"})


@dataclass(frozen=True)
class Verdict:
    """A rank the classifier judged failed.

    kind: `expired` (no heartbeat for `heartbeat_timeout_s`) or `hung`
        (heartbeats arrive but step and phase have not moved for `hang_timeout_s`).
    detected_after_s: From the last good heartbeat (expired) or from the last
        progress (hung) to the verdict.
    """

    rank: int
    kind: str
    detected_after_s: float
    last: Beat | None
    # Set when the rank was failed early, silent while every other rank waited on it
    # (`peer_wait_s`): the shortest time they had gone without progress.
    peers_waited_s: float | None = None

    def describe(self, timeout_s: float) -> str:
        where = f" on {self.last.node} (pid {self.last.pid})" if self.last else ""
        if self.kind == "hung":
            assert self.last is not None
            return (f"rank {self.rank}{where} hung: no progress for {self.detected_after_s:.1f}s "
                    f"at step {self.last.step} in phase {self.last.phase}")
        if self.last is None:
            return f"rank {self.rank} sent no heartbeat within {timeout_s:.0f}s of starting"
        waited = ("" if self.peers_waited_s is None else
                  f" while every other rank waited on it ({self.peers_waited_s:.1f}s without progress)")
        return (f"rank {self.rank}{where} stopped heartbeating {self.detected_after_s:.1f}s ago "
                f"(last at step {self.last.step}, phase {self.last.phase}){waited}")


@dataclass
class _Seen:
    beat: Beat | None = None
    fresh_at: float = 0.0  # classifier clock when a new beat (new seq/ts) was last seen


@dataclass
class Classifier:
    """Judges ranks from what the controller reads each poll.

    Times passed in are the controller's own monotonic clock for freshness
    and wall time for `detected_after_s`, so the verdicts do not depend on
    the workers' clocks agreeing with the controller's.

    With `peer_wait_s` (the spec's `peer_wait_timeout_s`), a rank silent that long
    is failed before `heartbeat_timeout_s` when every other rank beats and has made
    no progress for as long, in a timed phase: they wait on it in a collective. A
    rank that is merely slow to beat leaves its peers stepping (`peer_wait`).
    """

    ranks: Sequence[int]
    heartbeat_timeout_s: float
    hang_timeout_s: float
    grace_s: float = 0.0
    pids: dict[int, int] = field(default_factory=dict)  # rank -> the pid placed there
    fenced: frozenset[str] = frozenset()  # fenced processes, `pid@node`
    peer_wait_s: float | None = None
    _seen: dict[int, _Seen] = field(default_factory=dict)
    _hold_until: float = 0.0
    started: bool = False

    def start(self, now: float) -> None:
        """Begin watching: ranks get `heartbeat_timeout_s` from now to send a first beat."""
        self._seen = {r: _Seen(None, now) for r in self.ranks}
        self.started = True

    def store_failed(self, now: float) -> None:
        """The read failed: hold verdicts until the store has been back for a while."""
        self._hold_until = max(self._hold_until, now + self.heartbeat_timeout_s + self.grace_s)
        for seen in self._seen.values():  # nobody can be blamed for beats we could not read
            seen.fresh_at = max(seen.fresh_at, now)

    def observe(self, beats: dict[int, Beat | None], now: float, wall: float | None = None
                ) -> list[Verdict]:
        """Take one scan's beats (None for a missing key) and return the failed ranks."""
        if not self.started:
            self.start(now)
        wall = time.time() if wall is None else wall
        held = now < self._hold_until
        pids, fenced = self.pids, self.fenced
        timeout_s, hang_s, quiet_s = self.heartbeat_timeout_s, self.hang_timeout_s, self.peer_wait_s
        all_seen, get = self._seen, beats.get
        out, quiet = [], []
        # One pass over every rank each poll (131,072 of them at the largest scale
        # bench/heartbeats.py runs): the common cases cost a few comparisons each.
        for rank in self.ranks:
            seen = all_seen[rank]
            beat = get(rank)
            if beat is not None:
                last = seen.beat
                if beat is last:  # the scan's cache handed back the beat seen before
                    if fenced and member(beat.pid, beat.node) in fenced:
                        beat = None  # fenced since: as if none came
                elif (pids or fenced) and self._stale(rank, beat):
                    beat = None  # another process's: as if none came
                elif last is None or beat.seq != last.seq or beat.ts != last.ts:
                    seen.beat, seen.fresh_at = beat, now
            if held:
                continue
            if now - seen.fresh_at > timeout_s:
                last = seen.beat
                since = wall - last.ts if last else now - seen.fresh_at
                out.append(Verdict(rank, "expired", max(0.0, since), last))
            elif (beat is not None and beat.ts - beat.progress_ts > hang_s
                  and beat.phase not in UNTIMED_PHASES):
                out.append(Verdict(rank, "hung", beat.stalled_s, beat))
            elif quiet_s is not None and now - seen.fresh_at > quiet_s:
                quiet.append(rank)
        if quiet and not held:
            out += self._waited_on(quiet, {v.rank for v in out}, beats, now, wall)
        return out

    def _waited_on(self, quiet: list[int], judged: set[int], beats: dict[int, Beat | None],
                   now: float, wall: float) -> list[Verdict]:
        """The quiet ranks as failed, when every other rank not `judged` has this scan's
        beat (its own process's) and has waited `peer_wait_s` without progress, outside
        the untimed phases. A second pass, run only while a rank is quiet."""
        assert self.peer_wait_s is not None
        skip = judged.union(quiet)
        live = (b if b is not None and not self._stale(r, b) else None
                for r in self.ranks if r not in skip for b in (beats.get(r),))
        waited = peer_wait(live, self.peer_wait_s)  # stops at the first rank that steps
        if waited is None:
            return []
        out = []
        for rank in quiet:
            seen = self._seen[rank]
            since = wall - seen.beat.ts if seen.beat else now - seen.fresh_at
            out.append(Verdict(rank, "expired", max(0.0, since), seen.beat, waited))
        return out

    def _stale(self, rank: int, beat: Beat) -> bool:
        """Whether a process other than the one placed at `rank`, or a fenced one, wrote `beat`."""
        pid = self.pids.get(rank)
        return (pid is not None and beat.pid != pid) or (
            bool(self.fenced) and member(beat.pid, beat.node) in self.fenced)

    def last_beat(self, rank: int) -> Beat | None:
        seen = self._seen.get(rank)
        return seen.beat if seen else None


def peer_wait(beats: Iterable[Beat | None], wait_s: float) -> float | None:
    """How long the least stalled of these beats (every live rank's) has gone without
    progress, when each has for `wait_s` in a timed phase; else None (one of them
    steps, starts or has finished, or there is none)."""
    least = None
    for beat in beats:
        if beat is None or beat.phase in UNTIMED_PHASES or beat.ts - beat.progress_ts < wait_s:
            return None
        least = beat.stalled_s if least is None else min(least, beat.stalled_s)
    return least
