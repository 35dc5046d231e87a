"""The heartbeat record one rank writes and the controller reads.

Every rank's heartbeat thread (workers/runtime/heartbeat.py) writes one Redis
key per beat, `{prefix}job:{id}:hb:{rank}`, with a TTL of `heartbeat_timeout_s`.
The value is a short delimited string (parsing 16k JSON objects per scan
would cost more than the scan itself):

    step | phase | pid | node | ts | progress_ts | seq

`progress_ts` is when the rank last changed step or phase, on the rank's own
clock, so a hang is judged from one clock and never from two machines' skew.
How the controller judges the beats is platform/execution/heartbeat.py's business.
"""

from __future__ import annotations

from typing import NamedTuple

PHASES = ("init", "train", "data", "forward", "backward", "optimizer", "checkpoint", "collective",
          "done")
_SEP = "|"


class Beat(NamedTuple):
    """One heartbeat of one rank. A NamedTuple: a scan builds 16k of these."""

    rank: int
    step: int
    phase: str
    pid: int
    node: str
    ts: float
    progress_ts: float
    seq: int = 0

    def encode(self) -> str:
        # Phase and node are free text (`ctx.phase(name)`, node names): a separator
        # in them would make the beat undecodable, i.e. a live rank look dead.
        return _SEP.join((str(self.step), self.phase.replace(_SEP, "_"), str(self.pid),
                          self.node.replace(_SEP, "_"), f"{self.ts:.3f}", f"{self.progress_ts:.3f}",
                          str(self.seq)))

    @classmethod
    def decode(cls, rank: int, raw: str | bytes) -> Beat | None:
        """Parse a stored beat; None for a malformed value (treated as missing)."""
        if isinstance(raw, bytes):
            raw = raw.decode(errors="replace")
        parts = raw.split(_SEP)
        if len(parts) != 7:
            return None
        try:
            return cls(rank, int(parts[0]), parts[1], int(parts[2]), parts[3], float(parts[4]),
                       float(parts[5]), int(parts[6]))
        except ValueError:
            return None

    @property
    def stalled_s(self) -> float:
        """How long the rank has been on this step and phase, by its own clock."""
        return max(0.0, self.ts - self.progress_ts)
