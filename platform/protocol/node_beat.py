"""The heartbeat record a node agent writes for all of one job's ranks on its node.

Without an agent each rank writes its own key (`heartbeat.py` in this folder).
With one, the ranks of a node hand their beats to the agent through files in a
node-local folder, and the agent writes one Redis key per node per interval,
`{prefix}job:{id}:nb:{node}`, with a TTL of `heartbeat_timeout_s`. The
controller then reads one key per node instead of one per rank.

The value is a header line and one line of fields, so a scan splits each
record once instead of once per rank:

    agent_pid | node | ts | seq
    rank | step | phase | pid | ts | progress_ts | seq | rank | step | ...

Each rank's fields are its own `Beat` (its own clock, its own seq), so the
controller judges every rank exactly as it would from the rank's own key.

The agent answers each rank through an ack file in the same folder
(`Ack`): which of its beats reached Redis, which of the node's processes are
fenced, the job's flags and the ranks asked for their stacks. A rank renews its
lease from the ack, and falls back to its own key when acks stop coming.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from kuangchao.platform.protocol.heartbeat import Beat

_SEP = "|"
_FIELDS = 7  # per rank in the body
ACK_FILE = "ack"


class NodeRecord(NamedTuple):
    """One agent's record: its process, its clock, and the beats it relays."""

    node: str
    agent_pid: int
    ts: float
    seq: int
    beats: dict[int, Beat]


def _clean(text: str) -> str:
    return text.replace(_SEP, "_").replace("\n", " ")


def encode_node_record(node: str, agent_pid: int, ts: float, seq: int,
                       beats: Iterable[Beat]) -> str:
    head = _SEP.join((str(agent_pid), _clean(node), f"{ts:.3f}", str(seq)))
    body = _SEP.join(_SEP.join((str(b.rank), str(b.step), _clean(b.phase), str(b.pid),
                                f"{b.ts:.3f}", f"{b.progress_ts:.3f}", str(b.seq)))
                     for b in beats)
    return head + "\n" + body


def decode_node_record(raw: str | bytes) -> NodeRecord | None:
    """Parse a stored record; None when malformed (as if the agent had written nothing).
    One malformed rank entry spoils the whole record: its fields would be misaligned."""
    if isinstance(raw, bytes):
        raw = raw.decode(errors="replace")
    head, _, body = raw.partition("\n")
    h = head.split(_SEP)
    if len(h) != 4:
        return None
    try:
        node, agent_pid, ts, seq = h[1], int(h[0]), float(h[2]), int(h[3])
        beats: dict[int, Beat] = {}
        if body:
            f = body.split(_SEP)
            if len(f) % _FIELDS:
                return None
            for i in range(0, len(f), _FIELDS):
                rank = int(f[i])
                beats[rank] = Beat(rank, int(f[i + 1]), f[i + 2], int(f[i + 3]), node,
                                   float(f[i + 4]), float(f[i + 5]), int(f[i + 6]))
    except ValueError:
        return None
    return NodeRecord(node, agent_pid, ts, seq, beats)


@dataclass
class Ack:
    """What the agent tells its node's ranks after each record reached Redis.

    ts: The agent's wall clock when it sent the record (same machine as the ranks).
    acked: pid -> the newest beat seq of that process that reached Redis (by
        process, not rank: a rank's replacement on the same node is another process).
    fenced: The job's fenced processes on this node (`pid@node`).
    flags: The job's flags (preempt, cancel, debug) as read with the record.
    stack_requests: Ranks the controller asked for their stacks.
    agent_pid: The agent's process.
    """

    ts: float
    acked: dict[int, int] = field(default_factory=dict)
    fenced: list[str] = field(default_factory=list)
    flags: dict[str, bool] = field(default_factory=dict)
    stack_requests: list[int] = field(default_factory=list)
    agent_pid: int = 0

    def encode(self) -> str:
        return json.dumps({"ts": self.ts, "acked": {str(k): v for k, v in self.acked.items()},
                           "fenced": self.fenced, "flags": self.flags,
                           "stack_requests": self.stack_requests, "agent_pid": self.agent_pid})

    @classmethod
    def decode(cls, raw: str) -> Ack | None:
        try:
            d = json.loads(raw)
            return cls(float(d["ts"]), {int(k): int(v) for k, v in d["acked"].items()},
                       [str(m) for m in d["fenced"]], {str(k): bool(v) for k, v in d["flags"].items()},
                       [int(r) for r in d["stack_requests"]], int(d.get("agent_pid", 0)))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
