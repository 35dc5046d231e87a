"""`Classifier`'s judgement, kept in numpy columns: for jobs with node agents.

At 131,072 ranks the per-rank `Classifier` spends ~110 ms a scan in its
Python loop, and the beats it is fed cost more to build than to judge. A
`BeatTable` holds each rank's last good beat as columns (step, pid, seq, ts,
progress_ts, phase, node) and takes a scan as one `ScanUpdate`: the entries
of the node records that changed (numpy, from node_columns.py), the ranks
whose beat is missing, and the few ranks read from their own keys. Every
rank is then judged with a handful of vectorised comparisons; Python runs
only for the ranks it flags.

The rules are `Classifier`'s, rank for rank (tests/unit/test_heartbeat_
classifier.py runs its cases against both):
- a beat counts only from the process placed at its rank, never from a
  fenced one; such a beat is as if none came;
- a beat is fresh when its seq or ts differs from the last good one;
- `expired`: nothing fresh for `heartbeat_timeout_s`;
- `hung`: this scan's beat is `hang_timeout_s` past its progress, outside
  the untimed phases;
- after a failed read, verdicts wait `heartbeat_timeout_s + grace_s`;
- with `peer_wait_s`, a rank silent that long is `expired` early when every
  other rank beats and has made no progress for as long, in a timed phase.
A rank not named in an update keeps this scan what it had the last: its
record did not change.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kuangchao.platform.execution.heartbeat import UNTIMED_PHASES, Verdict, peer_wait
from kuangchao.platform.jobs.fences import member
from kuangchao.platform.protocol.heartbeat import Beat
from kuangchao.platform.protocol.node_beat import phase_bytes, phase_name
from kuangchao.platform.protocol.node_columns import DTYPE


@dataclass
class ScanUpdate:
    """One scan, as `RelayView.update` builds it.

    ranks, entries, nodes: The beats the changed records carry (rank numbers,
        `DTYPE` rows, and each one's node as an index into the table's `nodes`).
    absent: Ranks whose beat is missing this scan.
    direct: Ranks read from their own keys and listed by no record: their beat, or None.
    """

    ranks: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    entries: np.ndarray = field(default_factory=lambda: np.empty(0, DTYPE))
    nodes: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    absent: Sequence[int] = ()
    direct: Mapping[int, Beat | None] = field(default_factory=dict)


class BeatTable:
    """`Classifier` over columns. `nodes` names the node indexes updates carry."""

    def __init__(self, ranks: Sequence[int], heartbeat_timeout_s: float, hang_timeout_s: float,
                 grace_s: float = 0.0, pids: Mapping[int, int] | None = None,
                 nodes: Sequence[str] = (), peer_wait_s: float | None = None) -> None:
        self.ranks = list(ranks)
        self.heartbeat_timeout_s, self.hang_timeout_s, self.grace_s = (
            heartbeat_timeout_s, hang_timeout_s, grace_s)
        self.peer_wait_s = peer_wait_s
        self.pids = dict(pids or {})
        self.fenced: frozenset[str] = frozenset()
        self.nodes: list[str] = []
        self._node_id: dict[str, int] = {}
        self._member_node: dict[str, int] = {}  # a node as fence members write it -> index
        for name in nodes:
            self._intern(name)
        n = len(self.ranks)
        self._rank = np.asarray(self.ranks, np.int64)
        self._pos = np.full(int(self._rank.max()) + 1 if n else 0, -1, np.int64)
        self._pos[self._rank] = np.arange(n)
        self._want = np.full(n, -1, np.int64)  # the placed pid, -1 where none is known
        for rank, pid in self.pids.items():
            if 0 <= rank < len(self._pos) and self._pos[rank] >= 0:
                self._want[self._pos[rank]] = pid
        self._check_pids = bool((self._want >= 0).any())
        self.beats = np.zeros(n, DTYPE)  # the last good beat of each rank
        self.node = np.zeros(n, np.int64)
        self.has = np.zeros(n, bool)  # a good beat was ever seen
        self.present = np.zeros(n, bool)  # this scan carries a good beat
        self.fresh_at = np.zeros(n)
        self._hold_until = 0.0
        self.started = False

    def start(self, now: float) -> None:
        """Begin watching: ranks get `heartbeat_timeout_s` from now to send a first beat."""
        self.fresh_at[:] = now
        self.has[:] = False
        self.present[:] = False
        self.started = True

    def store_failed(self, now: float) -> None:
        """The read failed: hold verdicts until the store has been back for a while."""
        self._hold_until = max(self._hold_until, now + self.heartbeat_timeout_s + self.grace_s)
        np.maximum(self.fresh_at, now, out=self.fresh_at)

    def observe(self, scan: ScanUpdate | Mapping[int, Beat | None], now: float,
                wall: float | None = None) -> list[Verdict]:
        """Take one scan and return the failed ranks. A mapping is a scan of every
        rank's own key (None, or no entry, for a missing one)."""
        if not self.started:
            self.start(now)
        wall = time.time() if wall is None else wall
        if not isinstance(scan, ScanUpdate):
            scan = ScanUpdate(direct={r: scan.get(r) for r in self.ranks})
        absent = [self._pos[r] for r in scan.absent if 0 <= r < len(self._pos)]
        self.present[np.asarray([i for i in absent if i >= 0], np.int64)] = False
        for rank, beat in scan.direct.items():
            if 0 <= rank < len(self._pos) and self._pos[rank] >= 0:
                self._take_one(int(self._pos[rank]), beat, now)
        if len(scan.ranks):
            self._take(self._pos[scan.ranks], scan.entries, scan.nodes, now)
        if self.fenced:  # a process fenced since its beat came: as if none had
            self.present &= ~self._fenced_mask(self.beats["pid"], self.node)
        if now < self._hold_until:
            return []
        return self._judge(now, wall)

    def _take(self, pos: np.ndarray, rows: np.ndarray, nodes: np.ndarray, now: float) -> None:
        known = pos >= 0  # a record may name a rank this job does not watch
        ok = known.copy()
        if self._check_pids:
            want = self._want[pos.clip(0)]
            ok &= (want < 0) | (rows["pid"] == want)
        if self.fenced:
            ok &= ~self._fenced_mask(rows["pid"], nodes)
        self.present[pos[known & ~ok]] = False  # another process's beat: as if none came
        pos, rows, nodes = pos[ok], rows[ok], nodes[ok]
        self.present[pos] = True
        last = self.beats[pos]
        fresh = ~self.has[pos] | (rows["seq"] != last["seq"]) | (rows["ts"] != last["ts"])
        pos = pos[fresh]
        self.beats[pos] = rows[fresh]
        self.node[pos] = nodes[fresh]
        self.has[pos] = True
        self.fresh_at[pos] = now

    def _take_one(self, i: int, beat: Beat | None, now: float) -> None:
        if beat is None or self._stale(i, beat):
            self.present[i] = False
            return
        self.present[i] = True
        last = self.beats[i]
        if self.has[i] and beat.seq == last["seq"] and beat.ts == last["ts"]:
            return
        self.beats[i] = (beat.rank, beat.pid, beat.step, beat.seq, beat.ts, beat.progress_ts,
                         phase_bytes(beat.phase))
        self.node[i] = self._intern(beat.node)
        self.has[i] = True
        self.fresh_at[i] = now

    def _stale(self, i: int, beat: Beat) -> bool:
        want = self._want[i]
        return (want >= 0 and beat.pid != want) or (
            bool(self.fenced) and member(beat.pid, beat.node) in self.fenced)

    def _intern(self, node: str) -> int:
        got = self._node_id.get(node)
        if got is None:
            got = self._node_id[node] = len(self.nodes)
            self._member_node.setdefault(node.replace("|", "_"), got)
            self.nodes.append(node)
        return got

    def _fenced_mask(self, pids: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        """Which (pid, node index) pairs the fence set holds."""
        pairs = []
        for m in self.fenced:
            pid, _, node = m.partition("@")
            at = self._member_node.get(node)
            if pid.isdigit() and at is not None:  # else a node this job never saw
                pairs.append(int(pid) * (1 << 24) + at)
        if not pairs:
            return np.zeros(len(pids), bool)
        return np.isin(pids.astype(np.int64) * (1 << 24) + nodes, np.asarray(pairs, np.int64))

    def _judge(self, now: float, wall: float) -> list[Verdict]:
        timeout_s, hang_s = self.heartbeat_timeout_s, self.hang_timeout_s
        expired = (now - self.fresh_at) > timeout_s
        stalled = self.present & ~expired & (
            (self.beats["ts"] - self.beats["progress_ts"]) > hang_s)
        out = []
        for i in np.flatnonzero(expired | stalled).tolist():
            rank = self.ranks[i]
            if expired[i]:
                last = self._beat(i)
                since = wall - last.ts if last else now - float(self.fresh_at[i])
                out.append(Verdict(rank, "expired", max(0.0, since), last))
                continue
            beat = self._beat(i)
            assert beat is not None
            if beat.phase not in UNTIMED_PHASES:
                out.append(Verdict(rank, "hung", beat.stalled_s, beat))
        if self.peer_wait_s is not None:
            judged = np.zeros(len(self.ranks), bool)
            judged[np.asarray([self._pos[v.rank] for v in out], np.int64)] = True
            out += self._waited_on(now, wall, judged)
        return out

    def _waited_on(self, now: float, wall: float, judged: np.ndarray) -> list[Verdict]:
        """`Classifier._waited_on` over the columns: the ranks silent for `peer_wait_s`
        (and not judged yet), when every other rank not judged has waited as long."""
        assert self.peer_wait_s is not None
        quiet = ~judged & ((now - self.fresh_at) > self.peer_wait_s)
        if not quiet.any():
            return []
        live = np.flatnonzero(~judged & ~quiet)
        waited = peer_wait((self._beat(int(i)) if self.present[i] else None for i in live),
                           self.peer_wait_s)  # stops at the first rank that steps
        if waited is None:
            return []
        out = []
        for i in np.flatnonzero(quiet).tolist():
            last = self._beat(i)
            since = wall - last.ts if last else now - float(self.fresh_at[i])
            out.append(Verdict(self.ranks[i], "expired", max(0.0, since), last, waited))
        return out

    def _beat(self, i: int) -> Beat | None:
        if not self.has[i]:
            return None
        rank, pid, step, seq, ts, progress_ts, phase = self.beats[i].tolist()
        return Beat(self.ranks[i], step, phase_name(phase), pid, self.nodes[int(self.node[i])],
                    ts, progress_ts, seq)

    def last_beat(self, rank: int) -> Beat | None:
        if not 0 <= rank < len(self._pos) or self._pos[rank] < 0:
            return None
        return self._beat(int(self._pos[rank]))
