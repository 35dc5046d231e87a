"""Node records (node_beat.py) decoded in bulk into numpy columns.

A scan of a 16,384-node job finds about half its records changed; parsing
their 65,000 beats into Python objects cost the controller half a second a
scan (bench/heartbeats.py). Binary records are sliced here instead (one
header unpack a record) and every changed record's entries become one
structured array: `numpy.frombuffer` of their concatenation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kuangchao.platform.protocol.node_beat import (
    ENTRY,
    MAGIC,
    decode_text_record,
    pack_entry,
    record_layout,
)

DTYPE = np.dtype([("rank", "<i4"), ("pid", "<i4"), ("step", "<i8"), ("seq", "<i8"),
                  ("ts", "<f8"), ("progress_ts", "<f8"), ("phase", "S16")])
assert DTYPE.itemsize == ENTRY.size  # the struct the agents pack, field for field


@dataclass
class Gathered:
    """The entries of the records one scan found changed, and whose they are.

    entries: Every entry, record after record.
    record: For each entry, the index (into the `nodes` the caller passed) of its record.
    agents: node index -> the agent pid each decodable record names.
    bad: Node indexes whose record could not be decoded (as if missing).
    counts: node index -> how many entries its record holds.
    """

    entries: np.ndarray
    record: np.ndarray
    agents: dict[int, int] = field(default_factory=dict)
    bad: list[int] = field(default_factory=list)
    counts: dict[int, int] = field(default_factory=dict)


def gather(changed: list[tuple[int, bytes | str]]) -> Gathered:
    """Decode `(node index, raw record)` pairs into one table of entries."""
    bodies: list[bytes] = []
    owners: list[int] = []
    sizes: list[int] = []
    out = Gathered(np.empty(0, DTYPE), np.empty(0, np.int64))
    for i, raw in changed:
        if isinstance(raw, str):
            raw = raw.encode(errors="replace")
        layout = record_layout(raw)
        if layout is not None:
            agent_pid, _, _, _, start, n = layout
            bodies.append(raw[start:])
        elif not raw.startswith(MAGIC) and (rec := decode_text_record(raw)) is not None:
            # An agent of an earlier version: its text record, packed as ours.
            agent_pid, n = rec.agent_pid, len(rec.beats)
            bodies.append(b"".join(pack_entry(b) for b in rec.beats.values()))
        else:
            out.bad.append(i)
            continue
        out.agents[i] = agent_pid
        out.counts[i] = n
        owners.append(i)
        sizes.append(n)
    if bodies:
        out.entries = np.frombuffer(b"".join(bodies), DTYPE)
        out.record = np.repeat(np.asarray(owners, np.int64), sizes)
    return out
