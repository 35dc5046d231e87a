"""Where Prometheus finds the ranks: file_sd groups written by the control plane.

Every rank registers its metrics endpoint in its job's key space
(`workers/runtime/telemetry.py`). The API server turns the registrations of active
jobs into Prometheus file_sd groups, one per rank, labelled `job`, `rank`
and `node`, and writes them to `KC_METRICS_SD_FILE` (`kc up`:
`$KC_HOME/prometheus/kc-workers.json`) every few seconds. The same list is
served as HTTP service discovery at `/v1/metrics/targets` for a Prometheus
that does not share the API server's disk (docker-compose, Kubernetes).

Entries of ranks beyond a job's current world size (after a shrink), and of
finished jobs, are left out: Prometheus stops scraping them.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # types only: the catalogue sits below the store, which records into it
    from kuangchao.platform.jobs.state import JobRecord
    from kuangchao.platform.jobs.store import JobStore

REFRESH_S = 5.0


def groups(jobs: list[JobRecord], registered: dict[str, dict[str, str]]) -> list[dict[str, Any]]:
    """file_sd groups from each job's registrations (rank -> JSON entry). Pure."""
    out = []
    for job in jobs:
        if not job.state.holds_resources:
            continue
        for rank, raw in sorted(registered.get(job.id, {}).items(), key=lambda kv: int(kv[0])
                                if str(kv[0]).isdigit() else -1):
            try:
                entry = json.loads(raw)
                r = int(rank)
            except (TypeError, ValueError):
                continue
            if r >= job.world_size or not isinstance(entry, dict) or not entry.get("addr"):
                continue
            out.append({"targets": [str(entry["addr"])],
                        "labels": {"job": job.id, "rank": str(r),
                                   "node": str(entry.get("node", ""))}})
    return out


def read_groups(store: JobStore) -> list[dict[str, Any]]:
    """The current groups, in two round trips."""
    jobs = [j for j in store.list_active() if j.state.holds_resources]
    if not jobs:
        return []
    return groups(jobs, store.targets([job.id for job in jobs]))


def write_file_sd(path: Path, data: list[dict[str, Any]]) -> bool:
    """Replace the file atomically when its content changes; Prometheus re-reads it
    on change. Returns whether it was written."""
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    try:
        if path.read_text() == text:
            return False
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".kc-sd-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # Prometheus may run as another user; addresses are not secret
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True
