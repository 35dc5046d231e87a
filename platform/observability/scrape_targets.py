"""Where Prometheus finds the ranks: file_sd groups written by the control plane.

Every rank registers its metrics endpoint in its job's key space
(`workers/runtime/telemetry.py`). The API server turns the registrations of active
jobs into Prometheus file_sd groups, one per rank, labelled `job`, `rank`
and `node`, and writes them to `KC_METRICS_SD_FILE` (`kc up`:
`$KC_HOME/prometheus/kc-workers.json`) every few seconds. The same list is
served as HTTP service discovery at `/v1/metrics/targets` for a Prometheus
that does not share the API server's disk (docker-compose, Kubernetes).

A registration is written by the rank, whose code is the job's own and not
trusted, so it only says which port to scrape. The target's host must be the
IP of the node the job's placement puts that rank on (the registry's node
view, from Ray), its port a non-privileged one, and the labels come from the
job record and its placement, never from the entry: a rank cannot point
Prometheus at another host, nor name another job, rank or node. Entries of
ranks the placement does not hold or beyond a job's current world size
(after a shrink), of finished jobs, and an address two ranks of a job both
claim, are left out: Prometheus stops scraping them. The scrape configs do
not honour the labels a rank serves (deploy/prometheus/prometheus.yml).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # types only: the catalogue sits below the store, which records into it
    from kuangchao.platform.jobs.state import JobRecord
    from kuangchao.platform.jobs.store import JobStore

REFRESH_S = 5.0


# Ports below 1024 are system services' (ssh on 22, ...); ranks bind ephemeral ones.
MIN_PORT, MAX_PORT = 1024, 65535
_RANK = re.compile(r"0|[1-9][0-9]{0,8}")
_PORT = re.compile(r"[0-9]{1,5}")


def target(addr: Any, node_ip: str | None) -> str | None:
    """`addr` ("host:port", "[v6]:port") as a scrape target when its host is
    `node_ip` and its port a non-privileged one, rebuilt from those two; else None."""
    if not isinstance(addr, str) or not node_ip:
        return None
    host, sep, port = addr.rpartition(":")
    if not sep or not _PORT.fullmatch(port) or not MIN_PORT <= int(port) <= MAX_PORT:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ip = ipaddress.ip_address(node_ip)
        if ipaddress.ip_address(host) != ip:
            return None
    except ValueError:  # not an IP (a name would make Prometheus resolve it)
        return None
    return f"[{ip}]:{int(port)}" if ip.version == 6 else f"{ip}:{int(port)}"


def groups(jobs: list[JobRecord], registered: dict[str, dict[str, str]],
           ips: dict[str, str]) -> list[dict[str, Any]]:
    """file_sd groups from each job's registrations (rank -> JSON entry), checked
    against its placement; `ips` maps a Ray node id to the node's IP. Pure."""
    out = []
    for job in jobs:
        if not job.state.holds_resources:
            continue
        placed = {p.rank: p for p in job.placement}
        found: list[tuple[int, str]] = []
        for rank, raw in registered.get(job.id, {}).items():
            rank = rank.decode() if isinstance(rank, bytes) else str(rank)
            if not _RANK.fullmatch(rank):
                continue
            r = int(rank)
            where = placed.get(r)
            if where is None or r >= job.world_size:
                continue
            try:
                entry = json.loads(raw)
            except (TypeError, ValueError):
                continue
            addr = target(entry.get("addr") if isinstance(entry, dict) else None,
                          ips.get(where.node_id))
            if addr is not None:
                found.append((r, addr))
        claims: dict[str, int] = {}
        for _, addr in found:
            claims[addr] = claims.get(addr, 0) + 1
        for r, addr in sorted(found):
            if claims[addr] > 1:  # one endpoint, two ranks: at least one entry is forged
                continue
            out.append({"targets": [addr],
                        "labels": {"job": job.id, "rank": str(r), "node": placed[r].node}})
    return out


def node_ips(view: Any) -> dict[str, str]:
    """Ray node id -> IP, from the registry's node view (`store.info("nodes")`)."""
    ips = view.get("ips") if isinstance(view, dict) else None
    if not isinstance(ips, dict):
        return {}
    return {str(k): v for k, v in ips.items() if isinstance(v, str) and v}


def read_groups(store: JobStore) -> list[dict[str, Any]]:
    """The current groups, in three round trips."""
    jobs = [j for j in store.list_active() if j.state.holds_resources]
    if not jobs:
        return []
    registered = store.targets([job.id for job in jobs])
    return groups(jobs, registered, node_ips(store.info("nodes")))


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
