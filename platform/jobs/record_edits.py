"""Edits of a job record that both stores build on their compare-and-set `update`:
annotating the newest restart or resize entry, and closing a resize. Pure."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from kuangchao.platform.jobs.state import JobRecord


class RecordEdits:
    """Mixed into a store that has `update(job_id, fn)`."""

    update: Callable[..., JobRecord | None]

    def annotate_restart(self, job_id: str, fields: dict[str, Any]) -> JobRecord | None:
        """Add timings to the newest restart entry, keeping fields already set.

        A no-op when the job has no restart or the newest one already has
        every field (a preemption's resume, say, must not touch it).
        """
        return self._annotate_last(job_id, "restart_log", fields)

    def annotate_resize(self, job_id: str, fields: dict[str, Any]) -> JobRecord | None:
        """Add fields to the newest resize entry, keeping those already set."""
        return self._annotate_last(job_id, "resize_log", fields)

    def _annotate_last(self, job_id: str, log: str, fields: dict[str, Any]) -> JobRecord | None:
        def add(j: JobRecord):
            entries = getattr(j, log)
            if not entries:
                return None
            last = entries[-1]
            new = {k: v for k, v in fields.items() if k not in last and v is not None}
            if not new:
                return None
            return dataclasses.replace(j, **{log: (*entries[:-1], {**last, **new})}), None
        return self.update(job_id, add)

    def close_resize(self, job_id: str, first_step_at: float, world_size: int) -> dict[str, Any] | None:
        """Stamp the open resize entry to `world_size` ranks with its first step and
        `resize_s` (decision to first step), in one update; returns it, or None."""
        out: dict[str, Any] = {}

        def close(j: JobRecord):
            last = j.resize_log[-1] if j.resize_log else None
            if (last is None or "first_step_at" in last or "requested_at" not in last
                    or last.get("to_world_size") != world_size):
                return None
            out.update(last, first_step_at=first_step_at,
                       resize_s=round(first_step_at - last["requested_at"], 3))
            return dataclasses.replace(j, resize_log=(*j.resize_log[:-1], dict(out))), None
        return out if self.update(job_id, close) is not None else None
