"""What both job stores (the Redis `JobStore` and the in-memory `MemoryStore`)
store and how: the caps of the capped lists and the encoding of each value.
Pure: no Redis import, so the in-memory store shares it.

Values are kept as the JSON text Redis holds; an in-memory store that kept the
objects themselves would hand out aliases that callers could change, and would
accept values Redis refuses.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

# What a job id may be (operations.new_job_id makes `<slug>-<8 hex>`). No `:`,
# `*`, `?`, `[` or `/`: an id is part of key names and ACL patterns, so one that
# held them would name another job's keys (`a:events` is job a's stream). Both
# stores answer such an id as a missing job.
JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def is_job_id(text: str) -> bool:
    return bool(JOB_ID.match(text))


LOG_CAP = 20_000
# The most one stored log line may take: 20,000 lines of it are at most 320 MB,
# where lines of any size could fill Redis. A longer line keeps its head.
LOG_LINE_BYTES = 16 * 1024
# A point per logged step: 50k points cover a million steps logged every 20.
METRICS_CAP = 50_000
EVENT_CAP = 5_000
REPORT_ANSWER_TTL_S = 600
STACK_TTL_S = 3600  # a rank's answer to a stack request
AUDIT_CAP = 200_000  # records the audit stream keeps (about: Redis trims it in whole nodes)
# What a retention purge did to one job (retention_store.py, memory_retention.py).
PURGED, KEPT, STALE = "purged", "kept", "stale"


def log_text(record: dict[str, Any]) -> str:
    """A log line as stored: its message cut to fit `LOG_LINE_BYTES`, saying so."""
    text = json.dumps(record, default=str)
    if len(text) <= LOG_LINE_BYTES:
        return text
    message = str(record.get("message", ""))
    head = LOG_LINE_BYTES // 2
    cut = {**record, "message": f"{message[:head]} [... {len(message) - head} characters cut]",
           "truncated": True}
    cut = {k: v if k == "message" or len(json.dumps(v, default=str)) < 1024 else "[cut]"
           for k, v in cut.items()}
    return json.dumps(cut, default=str)


def event_text(event: dict[str, Any]) -> str:
    """An event as stored: stamped with the time it was written, unless it has one."""
    return json.dumps({"ts": time.time(), **event}, default=str)


def created_event(created_at: float, state: str, message: str) -> str:
    """The first event of a job: its creation."""
    return json.dumps({"ts": created_at, "type": "state", "from": None, "to": state,
                       "message": message})


def progress_fields(progress: dict[str, Any]) -> tuple[str | None, dict[str, str]]:
    """`(initial_loss, other fields)` of a progress write, each JSON-encoded;
    `initial_loss` is written only when the hash has none yet."""
    rest = dict(progress)
    initial = rest.pop("initial_loss", None)
    return (json.dumps(initial) if initial is not None else None,
            {f: json.dumps(v) for f, v in rest.items()})


def decoded(raw: dict[str, str]) -> dict[str, Any]:
    """A hash of JSON values, decoded."""
    return {k: json.loads(v) for k, v in raw.items()}


def decoded_list(raw: list[str]) -> list[Any]:
    return [json.loads(item) for item in raw]


def loads_or_none(raw: str | None) -> Any:
    return json.loads(raw) if raw else None


def sample_fields_from(fields: list[str], step: int) -> list[str]:
    """The sample-record fields (`step/dp_size/dp_rank`) of `step` and later."""
    return [f for f in fields if int(f.split("/", 1)[0]) >= step]


def hash_value(value: Any) -> str:
    """A hash field's value as Redis stores it (it keeps text only)."""
    return value if isinstance(value, str) else str(value)
