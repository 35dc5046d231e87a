"""Job state in Redis: one `JobStore`, split by concern.

- records.py: job records, compare-and-set, the one commit script;
- streams.py: events, logs, the loss curve, progress, checkpoints, samples, reports;
- flags.py: cancel, preempt, resize, generations, stack requests, scheduler wake-ups;
- node_health.py: node failures, quarantine, cluster info;
- recorded.py: metric hashes (the recorders) and the ranks' scrape targets;
- credentials.py: API keys, token marks, the jobs' Redis users, the audit stream;
- debug_requests.py: `kc debug` and `kc profile` requests and their answers;
- beats.py: the ranks' heartbeats;
- fences.py: the rank processes the controller replaced, which must write no more;
- retention_store.py: a finished job forgotten once its retention is over.

Key names come from keys.py (docs/architecture.md has the table); opening the
connection is redis_client.py's.
"""

from __future__ import annotations

import redis

from kuangchao.platform.jobs.beats import Beats
from kuangchao.platform.jobs.credentials import Credentials
from kuangchao.platform.jobs.debug_requests import DebugRequests
from kuangchao.platform.jobs.fences import Fences
from kuangchao.platform.jobs.flags import ControlFlags
from kuangchao.platform.jobs.node_health import NodeHealth
from kuangchao.platform.jobs.recorded import Recorded
from kuangchao.platform.jobs.records import COMMIT_SCRIPT, CREATE_SCRIPT, Records
from kuangchao.platform.jobs.redis_client import connect
from kuangchao.platform.jobs.retention_store import PURGE_SCRIPT, Retention
from kuangchao.platform.jobs.streams import Streams


class JobStore(Records, Streams, ControlFlags, NodeHealth, Recorded, Credentials,
               DebugRequests, Beats, Fences, Retention):
    """Typed access to the job keys. Safe to share between threads."""

    def __init__(self, client: redis.Redis, prefix: str = "kc:") -> None:
        self.r = client
        self.p = prefix
        self._commit = client.register_script(COMMIT_SCRIPT)
        self._create = client.register_script(CREATE_SCRIPT)
        self._purge = client.register_script(PURGE_SCRIPT)

    def ping(self) -> bool:
        """Whether Redis answers (raises when it does not)."""
        return bool(self.r.ping())

    @classmethod
    def from_url(cls, url: str | None, prefix: str = "kc:") -> JobStore:
        return cls(connect(url), prefix)
