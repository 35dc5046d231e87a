"""Every Redis key kuangchao uses, named in one place.

Each builder takes the configured prefix (`KC_REDIS_PREFIX`, default `kc:`) and
returns the full key. `PATTERNS` gives each one's shape, which
docs/architecture.md's key table lists (a test compares the two and checks that
every builder matches its pattern). Pure: no Redis import.

A job's own keys all start with `job_prefix`: the job's Redis ACL user may reach
those and nothing else (platform/jobs/redis_acl.py). The job's fence set is
outside them on purpose: the controller writes it, the job's ranks only read it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

PATTERNS = {
    "job": "job:{id}",
    "jobs": "jobs",
    "active": "jobs:active",
    "events": "job:{id}:events",
    "logs": "job:{id}:logs",
    "progress": "job:{id}:progress",
    "curve": "job:{id}:curve",
    "job_metrics": "job:{id}:metrics",
    "checkpoints": "job:{id}:checkpoints",
    "cancel": "job:{id}:cancel",
    "preempt": "job:{id}:preempt",
    "resize": "job:{id}:resize",
    "generation": "job:{id}:generation",
    "rejoin": "job:{id}:rejoin",
    "samples": "job:{id}:samples",
    "controller": "job:{id}:controller",
    "reports": "job:{id}:reports",
    "answer": "job:{id}:answer:{rid}",
    "targets": "job:{id}:targets",
    "beat": "job:{id}:hb:{rank}",
    "node_beat": "job:{id}:nb:{node}",
    "stack_request": "job:{id}:stackreq:{rank}",
    "stacks": "job:{id}:stacks:{rank}",
    "debug_request": "job:{id}:debug:req",
    "debug_answers": "job:{id}:debug:{rid}",
    "link_probe": "job:{id}:linkprobe:{node}",
    "node_failures": "node:{name}:failures",
    "quarantine": "quarantine",
    "sched_wake": "sched:wake",
    "info": "info:{name}",
    "cluster_metrics": "metrics:cluster",
    "api_keys": "auth:keys",
    "revoked": "auth:revoked:{token}",
    "issued": "auth:issued:{job}",
    "auth_jobs": "auth:jobs",
    "job_user_secret": "auth:jobuser:{job}",
    "control_secret": "auth:control",
    "job_revoked": "auth:jobrevoked:{job}",
    "audit": "audit",
    "fenced": "fenced:{id}",
}


# -- a job's own keys ----------------------------------------------------------------
def job_prefix(p: str, job_id: str) -> str:
    """What every key of the job but its record starts with."""
    return f"{p}job:{job_id}:"


def job(p: str, job_id: str) -> str:
    return f"{p}job:{job_id}"


def _key(name: str) -> Callable[..., str]:
    """The builder `(prefix, *ids)` of `PATTERNS[name]`, its ids in the pattern's order;
    for keys no hot path builds (heartbeats, spelled out below, come 16k at a time)."""
    template = re.sub(r"\{[^}]*\}", "{}", PATTERNS[name])

    def build(p: str, *ids: object) -> str:
        return p + template.format(*ids)
    return build


events = _key("events")
logs = _key("logs")
progress = _key("progress")
curve = _key("curve")
job_metrics = _key("job_metrics")
checkpoints = _key("checkpoints")
cancel = _key("cancel")
preempt = _key("preempt")
resize = _key("resize")
generation = _key("generation")
rejoin = _key("rejoin")
samples = _key("samples")
controller = _key("controller")
reports = _key("reports")
targets = _key("targets")
debug_request = _key("debug_request")


def answer(p: str, job_id: str, report_id: str) -> str:
    return f"{p}job:{job_id}:answer:{report_id}"


def beat(p: str, job_id: str, rank: int) -> str:
    return f"{p}job:{job_id}:hb:{rank}"


def node_beat(p: str, job_id: str, node: str) -> str:
    """A node agent's record of the job's ranks on its node (protocol/node_beat.py)."""
    return f"{p}job:{job_id}:nb:{node}"


def stack_request(p: str, job_id: str, rank: int) -> str:
    return f"{p}job:{job_id}:stackreq:{rank}"


def stacks(p: str, job_id: str, rank: int) -> str:
    return f"{p}job:{job_id}:stacks:{rank}"


def debug_answers(p: str, job_id: str, request_id: str) -> str:
    return f"{p}job:{job_id}:debug:{request_id}"


def link_probe(p: str, job_id: str, node: str) -> str:
    return f"{p}job:{job_id}:linkprobe:{node}"


# -- the cluster's keys, and security's
jobs = _key("jobs")
active = _key("active")
quarantine = _key("quarantine")
sched_wake = _key("sched_wake")
cluster_metrics = _key("cluster_metrics")
api_keys = _key("api_keys")
control_secret = _key("control_secret")
job_revoked = _key("job_revoked")
auth_jobs = _key("auth_jobs")
audit = _key("audit")
fenced = _key("fenced")  # the job's replaced rank processes (platform/jobs/fences.py)


def node_failures(p: str, name: str) -> str:
    return f"{p}node:{name}:failures"


def info(p: str, name: str) -> str:
    return f"{p}info:{name}"


def revoked(p: str, token_id: str) -> str:
    return f"{p}auth:revoked:{token_id}"


def issued(p: str, job_id: str) -> str:
    return f"{p}auth:issued:{job_id}"


def job_user_secret(p: str, job_id: str) -> str:
    return f"{p}auth:jobuser:{job_id}"
