"""JSON log lines for the control plane's processes.

Every record becomes one JSON object per line: `ts`, `level`, `module` (the
component: scheduler, controller, registry, authority, api), `logger`,
`message`, and `job_id` and `rank` when the record concerns one (passed as
`extra={"job_id": ..., "rank": ...}`, or set for the whole process, as a
job's controller does). Ranks write the same fields to the job log
(`workers/runtime/joblog.py`), which `kc logs` reads.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, component: str, job_id: str | None = None) -> None:
        super().__init__()
        self.component, self.job_id = component, job_id

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6), "level": record.levelname, "module": self.component,
            "logger": record.name, "message": record.getMessage(),
            "job_id": getattr(record, "job_id", self.job_id), "rank": getattr(record, "rank", None)}
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in out:
                out[key] = value if isinstance(value, str | int | float | bool | None) else repr(value)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def use_json_logs(component: str, job_id: str | None = None, level: int = logging.INFO) -> None:
    """Send this process's log records to stderr as JSON lines (Ray keeps an actor's
    stderr in its session log directory; `kc up` keeps the API server's in
    `$KC_HOME/logs/api.log`). Idempotent: a second call replaces the handler."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h.formatter, JsonFormatter):
            root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(component, job_id))
    root.addHandler(handler)
    root.setLevel(level)


