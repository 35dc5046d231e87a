"""An in-memory job store: the `JobStore` contract without Redis.

The scheduler's and the controller's unit tests run on it, and
tests/store_contract.py holds it to the same behaviour as the Redis store (the
suite runs against both; where they differ, Redis is right). It is native
Python, not a fake Redis: one lock guards plain dicts and lists, one condition
wakes the scheduler, and values are kept as the JSON text Redis would hold
(platform/jobs/encoding.py), so callers get fresh objects back. Pure: no Redis,
Ray or torch import.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import threading
import time
from collections import defaultdict
from typing import Any

from kuangchao.platform.errors import JobNotFound
from kuangchao.platform.jobs.encoding import (
    EVENT_CAP,
    LOG_CAP,
    METRICS_CAP,
    REPORT_ANSWER_TTL_S,
    STACK_TTL_S,
    created_event,
    decoded,
    decoded_list,
    event_text,
    hash_value,
    is_job_id,
    loads_or_none,
    log_text,
    progress_fields,
    sample_fields_from,
)
from kuangchao.platform.jobs.memory_more import Expiring, MemoryExtras
from kuangchao.platform.jobs.memory_retention import MemoryRetention
from kuangchao.platform.jobs.memory_security import MemorySecurity
from kuangchao.platform.jobs.record_edits import RecordEdits
from kuangchao.platform.jobs.state import JobRecord
from kuangchao.platform.observability import metrics


class _Jobs:
    """Records by id with their creation order, and the unfinished ones."""

    def __init__(self) -> None:
        self.text: dict[str, str] = {}
        self.order: list[tuple[float, str]] = []  # (created_at, id), as the `jobs` sorted set
        self.active: set[str] = set()

    def index(self, job_id: str, created_at: float) -> None:
        self.order = [e for e in self.order if e[1] != job_id]
        bisect.insort(self.order, (created_at, job_id))


class MemoryStore(RecordEdits, MemoryExtras, MemorySecurity, MemoryRetention):
    """Everything `JobStore` offers, held in this process. Safe to share between threads."""

    def __init__(self, prefix: str = "kc:") -> None:
        self.p = prefix  # kept for the names it shows (metrics registries key on it)
        self._lock = threading.RLock()
        self._woken = threading.Condition(self._lock)
        self._jobs = _Jobs()
        # job id -> appended JSON items, per stream
        self._streams: dict[str, defaultdict[str, list[str]]] = {
            name: defaultdict(list) for name in ("events", "logs", "curve", "checkpoints", "reports")}
        self._progress: defaultdict[str, dict[str, str]] = defaultdict(dict)
        self._samples: defaultdict[str, dict[str, str]] = defaultdict(dict)
        self._controllers: dict[str, str] = {}
        self._answers = Expiring()  # (job, report id) -> JSON answer
        self._flags: dict[tuple[str, str], Any] = {}
        self._stack_asks = Expiring()  # (job, rank) -> "1"
        self._stack_texts = Expiring()  # (job, rank) -> the rank's stacks
        self._wakes: list[str] = []
        self._failures: dict[str, dict[str, float]] = {}  # node -> {member: ts}
        self._failures_until: dict[str, float] = {}
        self._quarantine: dict[str, str] = {}
        self._info: dict[str, str] = {}
        MemoryExtras.__init__(self)
        MemorySecurity.__init__(self)

    def ping(self) -> bool:
        return True

    # -- records ---------------------------------------------------------------
    def create(self, job: JobRecord, event_message: str = "submitted",
               audit_line: str | None = None) -> JobRecord:
        job = dataclasses.replace(job, version=1)
        if audit_line is not None:
            self.append_audit(audit_line)
        with self._lock:
            self._jobs.text.setdefault(job.id, json.dumps(job.to_json()))  # SET NX
            self._jobs.index(job.id, job.created_at)
            self._jobs.active.add(job.id)
            self._streams["events"][job.id].append(
                created_event(job.created_at, job.state.value, event_message))
            self._wake(job.id)
        return job

    def get(self, job_id: str) -> JobRecord:
        with self._lock:
            raw = self._jobs.text.get(job_id) if is_job_id(job_id) else None
        if raw is None:
            raise JobNotFound.for_id(job_id)
        return JobRecord.from_json(json.loads(raw))

    def list(self, limit: int = 1000, before: int = 0) -> list[JobRecord]:
        """The newest `limit` jobs, oldest first; with `before`, the newest `before`
        are skipped (the next page back)."""
        with self._lock:  # ZRANGE -(before+limit) -(before+1)
            ids = [i for _, i in self._jobs.order[-(before + limit):len(self._jobs.order) - before]]
        return self._loaded(ids)

    def jobs_before(self, before: tuple[float, str] | None,
                    count: int) -> list[tuple[float, str, JobRecord | None]]:
        """As `JobStore.jobs_before`: the index's entries just older than `before`."""
        with self._lock:
            end = len(self._jobs.order) if before is None else bisect.bisect_left(
                self._jobs.order, before)
            got = self._jobs.order[max(0, end - count):end][::-1]
            raws = [self._jobs.text.get(i) for _, i in got]
        return [(s, i, JobRecord.from_json(json.loads(r)) if r else None)
                for (s, i), r in zip(got, raws, strict=True)]

    def list_active(self) -> list[JobRecord]:
        """Every job that has not finished, however old, oldest first."""
        with self._lock:
            ids = list(self._jobs.active)
        return sorted(self._loaded(ids), key=lambda j: (j.created_at, j.id))

    def _loaded(self, ids: list[str]) -> list[JobRecord]:
        with self._lock:
            raws = [self._jobs.text.get(i) for i in ids]
        return [JobRecord.from_json(json.loads(r)) for r in raws if r]

    def _commit_change(self, cur: JobRecord, new: JobRecord, event: dict[str, Any] | None) -> bool | None:
        """The commit script's step, under the lock (`update` runs `fn` outside it, so
        `fn` may run again when another writer got in first)."""
        finishing = new.state.is_terminal and not cur.state.is_terminal
        if finishing:
            counted = metrics.increments(metrics.JOBS_FINISHED, 1.0,
                                         {"state": new.state.value, "queue": new.queue})
        with self._lock:
            stored = self._jobs.text.get(new.id)
            if stored is None:
                return None
            if json.loads(stored).get("version") != cur.version:
                return False
            self._jobs.text[new.id] = json.dumps(new.to_json())
            if event:
                self._append("events", new.id, [event_text(event)], EVENT_CAP)
            if finishing:
                self._jobs.active.discard(new.id)
                self._drop_targets(new.id)
                self._add_metric_fields(None, counted)
        return True

    def claim_controller(self, job_id: str, ident: str) -> str | None:
        """Record `ident` (`name/pid`) as the job's controller; return the one recorded before."""
        with self._lock:
            before, self._controllers[job_id] = self._controllers.get(job_id), ident
        return before

    def controller(self, job_id: str) -> str | None:
        with self._lock:
            return self._controllers.get(job_id)

    # -- streams ---------------------------------------------------------------
    def _append(self, stream: str, job_id: str, items: list[str], cap: int | None = None) -> None:
        with self._lock:
            kept = self._streams[stream][job_id]
            kept.extend(items)
            if cap is not None and len(kept) > cap:
                del kept[:-cap]

    def _read(self, stream: str, job_id: str, start: int = 0) -> list[Any]:
        with self._lock:
            raw = list(self._streams[stream].get(job_id, ())[start:])
        return decoded_list(raw)

    def add_event(self, job_id: str, event: dict[str, Any]) -> None:
        self._append("events", job_id, [event_text(event)], EVENT_CAP)

    def events(self, job_id: str, start: int = 0) -> list[dict[str, Any]]:
        return self._read("events", job_id, start)

    def add_logs(self, job_id: str, records: list[dict[str, Any]]) -> None:
        self._append("logs", job_id, [log_text(r) for r in records], LOG_CAP)

    def logs(self, job_id: str, start: int = 0) -> list[dict[str, Any]]:
        return self._read("logs", job_id, start)

    def add_metrics(self, job_id: str, points: list[dict[str, Any]]) -> None:
        self._append("curve", job_id, [json.dumps(p) for p in points], METRICS_CAP)

    def metrics(self, job_id: str, start: int = 0) -> list[dict[str, Any]]:
        return self._read("curve", job_id, start)

    def set_progress(self, job_id: str, progress: dict[str, Any]) -> None:
        initial, rest = progress_fields(progress)
        with self._lock:
            fields = self._progress[job_id]
            if initial is not None:
                fields.setdefault("initial_loss", initial)
            fields.update(rest)

    def progress(self, job_id: str) -> dict[str, Any]:
        with self._lock:
            return decoded(dict(self._progress.get(job_id, {})))

    def add_checkpoint(self, job_id: str, ckpt: dict[str, Any]) -> None:
        self._append("checkpoints", job_id, [json.dumps(ckpt)])

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        return self._read("checkpoints", job_id)

    def post_report(self, job_id: str, report: dict[str, Any]) -> None:
        self._append("reports", job_id, [json.dumps(report, default=str)])

    def take_reports(self, job_id: str) -> list[dict[str, Any]]:
        """Every report posted and not yet taken, oldest first; each is taken once."""
        with self._lock:
            taken = self._streams["reports"].pop(job_id, [])
        return decoded_list(taken)

    def answer_report(self, job_id: str, report_id: str, answer: Any,
                      ttl_s: int = REPORT_ANSWER_TTL_S) -> None:
        self._answers.put((job_id, report_id), json.dumps(answer), ttl_s)

    def report_answer(self, job_id: str, report_id: str) -> Any:
        return loads_or_none(self._answers.get((job_id, report_id)))

    def record_samples(self, job_id: str, fields: dict[str, str]) -> None:
        with self._lock:
            self._samples[job_id].update({f: hash_value(v) for f, v in fields.items()})

    def samples(self, job_id: str) -> dict[str, str]:
        with self._lock:
            return dict(self._samples.get(job_id, {}))

    def forget_samples_from(self, job_id: str, step: int) -> None:
        with self._lock:
            fields = self._samples.get(job_id, {})
            for f in sample_fields_from(list(fields), step):
                del fields[f]

    # -- control flags ------------------------------------------------------------
    def request_stacks(self, job_id: str, ranks: list[int], ttl_s: float = 60.0) -> None:
        for rank in ranks:
            self._stack_texts.pop((job_id, rank))
            self._stack_asks.put((job_id, rank), "1", int(ttl_s))

    def stack_requested(self, job_id: str, rank: int) -> bool:
        return self._stack_asks.get((job_id, rank)) is not None

    def answer_stacks(self, job_id: str, rank: int, text: str) -> None:
        self._stack_texts.put((job_id, rank), text, STACK_TTL_S)
        self._stack_asks.pop((job_id, rank))

    def stacks(self, job_id: str, ranks: list[int]) -> dict[int, str]:
        found = {r: self._stack_texts.get((job_id, r)) for r in ranks}
        return {r: text for r, text in found.items() if text}

    # One table of raised flags: (flag, job) -> value (cancel, preempt, resize, rejoin,
    # and the published generation).
    def _raise(self, flag: str, job_id: str, value: Any = "1") -> None:
        with self._lock:
            self._flags[flag, job_id] = value

    def _flag(self, flag: str, job_id: str) -> Any:
        with self._lock:
            return self._flags.get((flag, job_id))

    def _lower(self, flag: str, job_id: str) -> None:
        with self._lock:
            self._flags.pop((flag, job_id), None)

    def request_cancel(self, job_id: str) -> None:
        self._raise("cancel", job_id)
        self.wake_scheduler(job_id)

    def cancel_requested(self, job_id: str) -> bool:
        return self._flag("cancel", job_id) is not None

    def request_preempt(self, job_id: str, for_job: str) -> None:
        self._raise("preempt", job_id, for_job)

    def preempt_requested(self, job_id: str) -> bool:
        return self._flag("preempt", job_id) is not None

    def preempt_reason(self, job_id: str) -> str | None:
        return self._flag("preempt", job_id)

    def clear_preempt(self, job_id: str) -> None:
        self._lower("preempt", job_id)

    def request_resize(self, job_id: str) -> None:
        self._raise("resize", job_id)

    def resize_requested(self, job_id: str) -> bool:
        return self._flag("resize", job_id) is not None

    def clear_resize(self, job_id: str) -> None:
        self._lower("resize", job_id)

    def publish_generation(self, job_id: str, generation: dict[str, Any], signal: bool) -> None:
        with self._lock:  # both at once, as the Redis store's transaction
            self._raise("generation", job_id, json.dumps(generation))
            if signal:
                self._raise("rejoin", job_id, int(generation["gen"]))
            else:  # a group formed from scratch: no earlier request may reach its ranks
                self._lower("rejoin", job_id)

    def generation(self, job_id: str) -> dict[str, Any] | None:
        return loads_or_none(self._flag("generation", job_id))

    def rejoin_requested(self, job_id: str) -> int:
        """The generation ranks are asked to rejoin, 0 when none."""
        return self._flag("rejoin", job_id) or 0

    def clear_rejoin(self, job_id: str) -> None:
        self._lower("rejoin", job_id)

    def _wake(self, reason: str) -> None:
        with self._woken:
            self._wakes.append(reason)
            self._woken.notify_all()

    def wake_scheduler(self, reason: str = "") -> None:
        self._wake(reason or "tick")

    def wait_for_wake(self, timeout_s: float) -> None:
        """Block until someone wakes the scheduler or `timeout_s` passes; one wake-up
        serves all pending ones."""
        with self._woken:
            if self._woken.wait_for(lambda: bool(self._wakes), timeout=timeout_s or None):
                self._wakes.clear()

    # -- node health ------------------------------------------------------------
    def record_node_failure(self, node: str, ts: float, window_s: float) -> list[float]:
        """Add one failure to a node's history; return its failures within the window."""
        with self._lock:
            seen = self._failures.get(node) if self._failures_until.get(node, 0) > time.time() else None
            seen = dict(seen or {})
            seen[f"{ts:.6f}"] = ts  # one entry per instant, as the sorted set keeps it
            seen = {m: t for m, t in seen.items() if t > ts - window_s}
            self._failures[node] = seen
            self._failures_until[node] = time.time() + int(window_s) + 60
            return sorted(seen.values())

    def quarantine_node(self, node: str, entry: dict[str, Any]) -> None:
        with self._lock:
            self._quarantine[node] = json.dumps(entry)

    def release_node(self, node: str) -> bool:
        with self._lock:
            self._failures.pop(node, None)
            return self._quarantine.pop(node, None) is not None

    def quarantine(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return decoded(dict(self._quarantine))

    def set_info(self, name: str, value: dict[str, Any]) -> None:
        with self._lock:
            self._info[name] = json.dumps(value)

    def info(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            return loads_or_none(self._info.get(name))
