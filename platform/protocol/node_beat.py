"""The heartbeat record a node agent writes for all of one job's ranks on its node.

Without an agent each rank writes its own key (`heartbeat.py` in this folder).
With one, the ranks of a node hand their beats to the agent through files in a
node-local folder, and the agent writes one Redis key per node per interval,
`{prefix}job:{id}:nb:{node}`, with a TTL of `heartbeat_timeout_s`. The
controller then reads one key per node instead of one per rank.

The value is binary and fixed-width, so a scan decodes every changed record
of a 16,384-node job in one `numpy.frombuffer` (platform/protocol/
node_columns.py) instead of parsing 131,072 beats' fields in Python:

    header  "<4sIdQHH": magic b"KNB2", agent_pid, ts, seq, n, len(node)
    node    len(node) bytes of UTF-8
    n x     "<iiqqdd16s": rank, pid, step, seq, ts, progress_ts, phase

A phase name is kept to its first 16 bytes (`PHASE_BYTES`; the ones the
trainer uses are shorter). The text record of earlier versions (a header line
and one line of `|`-separated fields) is still decoded, so a controller can
judge the agents of a job started before an upgrade.

The agent answers each rank through an ack file in the same folder
(`Ack`): which of its beats reached Redis, which of the node's processes are
fenced, the job's flags and the ranks asked for their stacks. A rank renews its
lease from the ack, and falls back to its own key when acks stop coming.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from kuangchao.platform.protocol.heartbeat import Beat

_SEP = "|"
_FIELDS = 7  # per rank in the body of a text (v1) record
ACK_FILE = "ack"
MAGIC = b"KNB2"
HEADER = struct.Struct("<4sIdQHH")  # magic, agent_pid, ts, seq, n, len(node)
ENTRY = struct.Struct("<iiqqdd16s")  # rank, pid, step, seq, ts, progress_ts, phase
PHASE_BYTES = 16


class NodeRecord(NamedTuple):
    """One agent's record: its process, its clock, and the beats it relays."""

    node: str
    agent_pid: int
    ts: float
    seq: int
    beats: dict[int, Beat]


def _clean(text: str) -> str:
    return text.replace(_SEP, "_").replace("\n", " ")


def phase_bytes(phase: str) -> bytes:
    """A phase name as a record stores it: UTF-8, its first `PHASE_BYTES` bytes."""
    return phase.encode(errors="replace")[:PHASE_BYTES]


def pack_entry(b: Beat) -> bytes:
    """One rank's entry of a binary record."""
    return ENTRY.pack(b.rank, b.pid, b.step, b.seq, b.ts, b.progress_ts, phase_bytes(b.phase))


def encode_node_record(node: str, agent_pid: int, ts: float, seq: int,
                       beats: Iterable[Beat]) -> bytes:
    """The binary record of one agent's relayed beats (the module's layout)."""
    entries = [pack_entry(b) for b in beats]
    name = node.encode(errors="replace")
    return b"".join((HEADER.pack(MAGIC, agent_pid, ts, seq, len(entries), len(name)), name,
                     *entries))


def record_layout(raw: bytes) -> tuple[int, float, int, str, int, int] | None:
    """A binary record's (agent_pid, ts, seq, node, where its entries begin, how many),
    or None when it is not one, or its length does not match its count."""
    if len(raw) < HEADER.size or not raw.startswith(MAGIC):
        return None
    _, agent_pid, ts, seq, n, name_len = HEADER.unpack_from(raw)
    start = HEADER.size + name_len
    if len(raw) != start + n * ENTRY.size:
        return None
    return agent_pid, ts, seq, raw[HEADER.size:start].decode(errors="replace"), start, n


def phase_name(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode(errors="replace")


def decode_node_record(raw: str | bytes) -> NodeRecord | None:
    """Parse a stored record, binary or text; None when malformed (as if the agent had
    written nothing). One malformed rank entry spoils the whole record."""
    if isinstance(raw, bytes) and raw.startswith(MAGIC):
        layout = record_layout(raw)
        if layout is None:
            return None
        agent_pid, ts, seq, node, start, n = layout
        beats = {}
        for rank, pid, step, bseq, bts, pts, phase in ENTRY.iter_unpack(
                raw[start:start + n * ENTRY.size]):
            beats[rank] = Beat(rank, step, phase_name(phase), pid, node, bts, pts, bseq)
        return NodeRecord(node, agent_pid, ts, seq, beats)
    return decode_text_record(raw)


def encode_text_record(node: str, agent_pid: int, ts: float, seq: int,
                       beats: Iterable[Beat]) -> str:
    """The text record agents wrote before the binary one (kept to test its decoding)."""
    head = _SEP.join((str(agent_pid), _clean(node), f"{ts:.3f}", str(seq)))
    body = _SEP.join(_SEP.join((str(b.rank), str(b.step), _clean(b.phase), str(b.pid),
                                f"{b.ts:.3f}", f"{b.progress_ts:.3f}", str(b.seq)))
                     for b in beats)
    return head + "\n" + body


def decode_text_record(raw: str | bytes) -> NodeRecord | None:
    """Parse a text (v1) record; None when malformed."""
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
