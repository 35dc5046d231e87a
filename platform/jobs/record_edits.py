"""What both stores build on their one compare-and-set step (`_commit_change`):
`update`, annotating the newest restart or resize entry, and closing a resize. Pure."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from kuangchao.platform.errors import JobNotFound, StoreUnavailable
from kuangchao.platform.jobs.state import JobRecord


class RecordEdits:
    """Mixed into a store that has `get` and `_commit_change`."""

    get: Callable[[str], JobRecord]

    def _commit_change(self, cur: JobRecord, new: JobRecord, event: dict[str, Any] | None) -> bool | None:
        """Store `new` (with its event) if `cur` is still the stored version: True when
        done, False when another writer got in first, None when the record is gone."""
        raise NotImplementedError

    def update(
        self,
        job_id: str,
        fn: Callable[[JobRecord], tuple[JobRecord, dict | None] | None],
        attempts: int = 50,
    ) -> JobRecord | None:
        """Read-modify-write with compare-and-set.

        Args:
            job_id: The job.
            fn: Given the current record, returns `(new_record, event_or_None)`,
                or None to leave the record alone. It may run more than once.

        Returns:
            The stored new record, or None when `fn` chose not to change it.
        """
        for _ in range(attempts):
            cur = self.get(job_id)
            out = fn(cur)
            if out is None:
                return None
            new, event = out
            new = dataclasses.replace(new, version=cur.version + 1)
            done = self._commit_change(cur, new, event)
            if done is None:
                raise JobNotFound(f"job {job_id!r} vanished from the store")
            if done:
                return new
        raise StoreUnavailable(f"job {job_id}: too much write contention; retry the request")

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
