"""Which source each rank's beat comes from: its node agent's record, or its own key.

Pure: the controller's watch (watch.py) and bench/heartbeats.py feed it what
one scan read, and it answers one beat (or None) per rank for the `Classifier`.

The rule, per rank:
- A rank its node's agent lists is *covered*: its beat comes from the agent's
  record alone, and its own key is not read.
- A covered rank stays covered while its agent's record is missing. A dead agent
  is then a lost node: its ranks' beats stop, and they expire as a dead rank's
  would, `heartbeat_timeout_s` after the agent's last record. (Ranks that fell
  back to their own keys meanwhile are not counted: their node's agent, the
  part of the node the controller watches, is gone.)
- A rank the agent's record no longer lists, or whose node has no agent, is read
  from its own key, from the next scan on: a rank falls back to its own key
  when its agent's acks stop, and takes its beat file away (workers/runtime/
  beat_relay.py); a rank that cannot reach the agent's folder never wrote one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from kuangchao.platform.execution.beat_table import ScanUpdate
from kuangchao.platform.protocol.heartbeat import Beat
from kuangchao.platform.protocol.node_columns import gather
from kuangchao.platform.spec.jobspec import JobSpec

# `node_agents: auto` starts agents for jobs this large: below it, the per-rank keys
# cost Redis and the scan little, and an agent costs a process on every node.
AUTO_MIN_RANKS = 64


def agents_wanted(spec: JobSpec) -> bool:
    mode = spec.fault_tolerance.node_agents
    return mode == "on" or (mode == "auto" and spec.world_size >= AUTO_MIN_RANKS)


class RelayView:
    """Turns one scan's reads into a `ScanUpdate` for `BeatTable`.

    Args:
        node_of: rank -> the node it was placed on (the name its agent writes under).

    The records are compared with the last scan's as bytes; only those that
    changed are decoded (node_columns.gather), all in one table.
    """

    def __init__(self, node_of: Mapping[int, str]) -> None:
        self.node_of = dict(node_of)
        self.nodes = sorted(set(self.node_of.values()))
        index = {n: i for i, n in enumerate(self.nodes)}
        self.ranks_of: dict[str, list[int]] = {n: [] for n in self.nodes}
        for rank, node in sorted(self.node_of.items()):
            self.ranks_of[node].append(rank)
        self._ranks = np.asarray(sorted(self.node_of), np.int64)
        top = int(self._ranks.max()) + 1 if len(self._ranks) else 0
        self._node_at = np.full(top, -1, np.int64)  # rank -> its node's index
        for rank, node in self.node_of.items():
            self._node_at[rank] = index[node]
        self._wanted = np.asarray([len(self.ranks_of[n]) for n in self.nodes], np.int64)
        self.covered = np.zeros(top, bool)  # by rank: its beat comes from its agent's record
        self.agents_seen: dict[str, int] = {}  # node -> the agent pid last seen
        self.gone: set[str] = set()  # nodes whose agent was seen and whose record is gone
        self._last: list[bytes | str | None] = [None] * len(self.nodes)
        self._bad: set[int] = set()  # nodes whose current record does not decode
        self._direct = [int(r) for r in self._ranks]

    def direct_ranks(self) -> list[int]:
        """The ranks whose own keys the next scan reads."""
        return self._direct

    def update(self, raws: Sequence[bytes | str | None],
               direct: Mapping[int, Beat | None]) -> ScanUpdate:
        """One scan: `raws` holds each node's record as read (None where it expired), in
        `nodes` order; `direct` the own keys of `direct_ranks()`."""
        changed: list[tuple[int, bytes | str]] = []
        missing: list[int] = []
        last, bad = self._last, self._bad
        for i, raw in enumerate(raws):
            if raw is None:
                missing.append(i)
            elif raw != last[i]:
                changed.append((i, raw))
            elif i in bad:
                missing.append(i)  # the same record that did not decode last time
            last[i] = raw
        got = gather(changed)
        for i, _ in changed:
            bad.discard(i)
        bad.update(got.bad)
        missing.extend(got.bad)
        absent: list[int] = []
        for i in missing:
            node = self.nodes[i]
            if node in self.agents_seen:
                self.gone.add(node)
            absent.extend(r for r in self.ranks_of[node] if self.covered[r])
        for i, pid in got.agents.items():
            self.agents_seen[self.nodes[i]] = pid
            self.gone.discard(self.nodes[i])
        ranks, rows, owner = self._placed(got.entries, got.record)
        joined = ranks[~self.covered[ranks]]  # listed now, read from their own keys before
        moved = self._cover(ranks, owner, got.agents, absent)
        if len(joined):  # the record's beat wins over the own key read in the same scan
            listed = set(joined.tolist())
            direct = {r: b for r, b in direct.items() if r not in listed}
        if moved:
            self._direct = [int(r) for r in self._ranks[~self.covered[self._ranks]]]
        return ScanUpdate(ranks, rows, owner, absent, direct)

    def _placed(self, rows: np.ndarray, owner: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The entries whose rank was placed on the node of the record that lists it."""
        ranks = rows["rank"].astype(np.int64)
        ok = (ranks >= 0) & (ranks < len(self._node_at))
        ok[ok] = self._node_at[ranks[ok]] == owner[ok]
        return ranks[ok], rows[ok], owner[ok]

    def _cover(self, ranks: np.ndarray, owner: np.ndarray, decoded: Mapping[int, int],
               absent: list[int]) -> bool:
        """Mark the ranks each decoded record lists as covered, and uncover those of its
        node it no longer lists (they fall back to their own keys). Whether any moved."""
        moved = not bool(self.covered[ranks].all()) if len(ranks) else False
        self.covered[ranks] = True
        listed = np.bincount(owner, minlength=len(self.nodes)) if len(owner) else None
        for i in decoded:
            if listed is not None and listed[i] >= self._wanted[i]:
                continue  # every rank of the node listed (the common case)
            # Entries come record after record in node order (gather), so a record's
            # are one slice: found in O(log n), not by a pass over every entry (at a
            # large job's start most records list only some of their ranks).
            lo, hi = np.searchsorted(owner, (i, i + 1))
            have = set(ranks[lo:hi].tolist())
            for rank in self.ranks_of[self.nodes[i]]:
                if rank not in have and self.covered[rank]:
                    self.covered[rank] = False  # fell back: its own key from the next scan
                    absent.append(rank)
                    moved = True
        return moved

    def agent_gone(self, rank: int) -> str | None:
        """The node of `rank`'s agent when the rank is covered and its agent's record is
        gone (a dead agent: the node is lost to the controller), else None."""
        if not 0 <= rank < len(self.covered) or not self.covered[rank]:
            return None
        node = self.node_of[rank]
        return node if node in self.gone else None
