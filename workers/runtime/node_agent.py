"""A node agent: one process per job and node that relays its ranks' heartbeats.

Every `interval_s` it reads the beat files of the job's ranks on its node
(workers/runtime/beat_relay.py) and, in one Redis round trip on the job's own
Redis user:
- writes one record of all the fresh beats (platform/protocol/node_beat.py),
  with a TTL of `heartbeat_timeout_s`;
- reads the job's fence set, its flags, and the stack requests of its ranks.
It then writes the ack the ranks read: which beat of each process reached
Redis, which of the node's processes are fenced, the flags, the requests.

So Redis sees one write and one connection per node and interval instead of
one per rank, and the controller scans one key per node.

A beat file not rewritten within two periods is not relayed: its rank is
stopped, dead, or beats on its own key (the controller then reads that key).
While Redis does not answer, no ack is written, and the ranks fall back to
their own keys, which they reach or not as they would without an agent.

If the agent itself dies, its record expires and the controller counts the
node as lost (platform/execution/relayed.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import redis

from kuangchao.platform.jobs import keys
from kuangchao.platform.jobs.beats import queue_node_record
from kuangchao.platform.jobs.flags import carried_flags
from kuangchao.platform.protocol.heartbeat import Beat
from kuangchao.platform.protocol.node_beat import ACK_FILE, Ack, encode_node_record
from kuangchao.workers.runtime.beat_relay import beat_folder, replace_file

log = logging.getLogger(__name__)


def read_beat_files(folder: Path, now: float, fresh_s: float) -> list[Beat]:
    """The beats in `folder` written within `fresh_s` of `now` (wall time)."""
    out = []
    try:
        names = os.listdir(folder)
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            beat = Beat.decode(int(name), (folder / name).read_text())
        except OSError:
            continue  # taken away meanwhile
        if beat is not None and now - beat.ts <= fresh_s:
            out.append(beat)
    return sorted(out)


class NodeAgent:
    """Relays one job's beats on one node until `stop`.

    Args:
        client: A heartbeat client on the job's Redis user (beat_client.heartbeat_client).
        prefix, job_id: The job's keys.
        node: The node's name, as its ranks' beats and the fence set write it.
        interval_s, timeout_s: The job's heartbeat period and TTL.
        folder: Where its ranks write (default: `beat_folder(job_id, node)`).
    """

    def __init__(self, client: redis.Redis, prefix: str, job_id: str, node: str,
                 interval_s: float, timeout_s: float, folder: Path | None = None) -> None:
        self.client, self.prefix, self.job_id, self.node = client, prefix, job_id, node
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.folder = folder or beat_folder(job_id, node)
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.flag_keys = carried_flags(prefix, job_id)
        self.seq = 0
        self.records = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def relay_once(self) -> Ack:
        """Write one record and its ack; raises when Redis does not answer."""
        now = time.time()
        beats = read_beat_files(self.folder, now, fresh_s=2 * self.interval_s)
        self.seq += 1
        record = encode_node_record(self.node, os.getpid(), now, self.seq, beats)
        with self.client.pipeline(transaction=False) as pipe:
            queue_node_record(pipe, self.prefix, self.job_id, self.node, record, self.timeout_s)
            pipe.smembers(keys.fenced(self.prefix, self.job_id))
            # One MGET for the flags and every relayed rank's stack request.
            pipe.mget([*self.flag_keys.values(),
                       *(keys.stack_request(self.prefix, self.job_id, b.rank) for b in beats)])
            replies = pipe.execute()
        n = len(self.flag_keys)
        suffix = "@" + self.node.replace("|", "_")
        values = replies[2]
        ack = Ack(ts=now, acked={b.pid: b.seq for b in beats},
                  fenced=sorted(m for m in replies[1] if m.endswith(suffix)),
                  flags={name: v is not None for name, v in zip(self.flag_keys, values[:n],
                                                                strict=True)},
                  stack_requests=[b.rank for b, v in zip(beats, values[n:], strict=True)
                                  if v is not None],
                  agent_pid=os.getpid())
        replace_file(self.folder / ACK_FILE, ack.encode())
        self.records += 1
        return ack

    def start(self) -> NodeAgent:
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"kc-node-agent-{self.job_id}")
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop relaying and take the folder away (its ranks then beat on their own)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
        shutil.rmtree(self.folder, ignore_errors=True)

    def _loop(self) -> None:
        failing = False
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                self.relay_once()
                if failing:
                    log.warning("node agent %s/%s: Redis answers again", self.job_id, self.node)
                failing = False
            except (redis.RedisError, OSError) as exc:
                self.failures += 1
                if not failing:  # its ranks beat on their own keys meanwhile
                    log.warning("node agent %s/%s: cannot relay (%s)", self.job_id, self.node, exc)
                failing = True
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t)))


class NodeAgentActor:
    """The Ray actor that hosts a `NodeAgent` (platform/execution/node_agents.py starts it
    on its node, with the job's Redis user and nothing else)."""

    def __init__(self, redis_url: str, prefix: str, job_id: str, node: str,
                 interval_s: float, timeout_s: float) -> None:
        from kuangchao.workers.runtime.beat_client import heartbeat_client

        self.agent = NodeAgent(heartbeat_client(redis_url, timeout_s), prefix, job_id, node,
                               interval_s, timeout_s).start()

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "node": self.agent.node, "records": self.agent.records,
                "failures": self.agent.failures, "folder": str(self.agent.folder)}

    def stop(self) -> None:
        self.agent.stop()
