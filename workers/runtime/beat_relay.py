"""A rank's side of its node agent: its beat goes to a file, the agent's ack comes back.

With a node agent (workers/runtime/node_agent.py), the ranks of one job on one
node share a folder on the node's memory file system. Each beat a rank's
heartbeat thread makes is written to `<folder>/<rank>` (a whole-file replace,
so the agent never reads half a beat); the agent relays every fresh beat file
in one Redis record per node, and writes `<folder>/ack` after each record
reached Redis (platform/protocol/node_beat.py).

The rank trusts an ack only while it is fresh (written within two beat
periods): then its own Redis round trip is skipped, and its lease is renewed
from when it wrote the beat the ack names, which is before the agent sent it,
so the lease never outlasts what the controller saw. Without a fresh ack (no
agent, an agent still starting, one that died) the rank beats on its own key as
it always did, and keeps writing its file, so that a live agent can take over
again. The folder is the job's and the node's: the agent of another job never
reads it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kuangchao.platform.protocol.heartbeat import Beat
from kuangchao.platform.protocol.node_beat import ACK_FILE, Ack

_SENT_KEPT = 64  # beats remembered for their ack: minutes of beats at any period


def beat_folder(job_id: str, node: str) -> Path:
    """Where one job's ranks on `node` and its agent meet: the node's memory file
    system when there is one (no disk writes once a second), else the temp folder."""
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{job_id}@{node}")
    return base / "kc-beats" / safe


def replace_file(path: Path, text: str) -> None:
    """Write `text` to `path` in one rename: a reader sees the old text or the new."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class BeatRelay:
    """One rank's beat file and its view of the agent's acks.

    Args:
        folder: The job's folder on this node (`beat_folder`).
        rank: The rank (the file's name).
        fresh_s: How old an ack may be and still be trusted (two beat periods).
    """

    def __init__(self, folder: Path, rank: int, fresh_s: float) -> None:
        self.folder, self.rank, self.fresh_s = folder, rank, fresh_s
        self.sent: dict[int, float] = {}  # beat seq -> the lease clock when it was written
        self.relayed = 0  # beats the agent acknowledged
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)

    @property
    def path(self) -> Path:
        return self.folder / str(self.rank)

    def write(self, beat: Beat, at: float) -> None:
        """Hand `beat` to the agent; `at` is the lease clock when it was made."""
        replace_file(self.path, beat.encode())
        self.sent[beat.seq] = at
        if len(self.sent) > _SENT_KEPT:
            for seq in sorted(self.sent)[:-_SENT_KEPT]:
                del self.sent[seq]

    def fresh_ack(self, now: float) -> tuple[Ack, float] | None:
        """The agent's newest ack and the lease clock of the newest beat of this
        process it names, when the ack is fresh (`now` is wall time); else None."""
        try:
            ack = Ack.decode((self.folder / ACK_FILE).read_text())
        except OSError:
            return None
        if ack is None or not 0 <= now - ack.ts <= self.fresh_s:
            return None
        seq = ack.acked.get(os.getpid())
        at = self.sent.get(seq) if seq is not None else None
        if at is None:
            return None
        self.relayed += 1
        return ack, at

    def rename(self, rank: int) -> None:
        """Beat under another number (a resize renumbered this rank)."""
        self.drop()
        self.rank = rank

    def drop(self) -> None:
        """Take the file away (a clean exit is not a death; a renamed rank's old number)."""
        try:
            self.path.unlink()
        except OSError:
            pass
