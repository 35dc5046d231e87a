"""A rank's heartbeat and job log, wired to its lease (workers/fence.py).

Split from worker.py, which builds a rank: the heartbeat starts with the
process, so even a hang in start-up is seen, and holds this process's lease;
the log sink ships on a client of the heartbeat's kind (short timeouts, no
retries, unsent bytes dropped on close), so that no log line begun while the
lease held can reach Redis after the controller may have replaced the rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.settings import Settings
from kuangchao.workers.runtime.beat_client import heartbeat_client
from kuangchao.workers.runtime.debug import DebugResponder
from kuangchao.workers.runtime.heartbeat import Heartbeat
from kuangchao.workers.runtime.joblog import JobLogSink
from kuangchao.workers.runtime.telemetry import WorkerTelemetry


def log_sink(store: JobStore | None, settings: Settings, job_id: str, rank: int,
             heartbeat: tuple[float, ...] | None) -> JobLogSink:
    """The rank's job log: with a heartbeat, on a client of the lease's kind."""
    if store is not None and settings.redis_url and heartbeat is not None:
        store = JobStore(heartbeat_client(settings.redis_url, heartbeat[1]), settings.redis_prefix)
    return JobLogSink(store, job_id, rank)


def start_heartbeat(settings: Settings, job_id: str, rank: int, node: str,
                    heartbeat: tuple[float, ...] | None, sink: JobLogSink,
                    store: JobStore | None, telemetry: WorkerTelemetry | None,
                    generation: Callable[[], int]) -> Heartbeat | None:
    """Start the rank's heartbeat (None without Redis or heartbeat settings): it carries
    progress and flags with a store, and answers `kc debug` with telemetry."""
    if not settings.redis_url or heartbeat is None:
        return None
    interval_s, timeout_s = heartbeat[0], heartbeat[1]

    def on_log(level: str, msg: str) -> None:
        sink.emit(msg, level=level, module="heartbeat")

    hb = Heartbeat(heartbeat_client(settings.redis_url, timeout_s), settings.redis_prefix, job_id,
                   rank, node, interval_s, timeout_s, on_log=on_log)
    if store is not None:
        hb.carry()
        if telemetry is not None:
            responder: Any = DebugResponder(hb.client, settings.redis_prefix, job_id, telemetry,
                                            generation)
            hb.on_debug = responder
    if len(heartbeat) > 2 and heartbeat[2]:  # the job runs node agents (node_agents.py)
        hb.relay_via(job_id, node)
    return hb.start()
