"""Every Redis key kuangchao uses, named in one place.

Each builder takes the configured prefix (`KC_REDIS_PREFIX`, default `kc:`) and
returns the full key. `PATTERNS` gives each one's shape, which
docs/architecture.md's key table lists (a test compares the two and checks that
every builder matches its pattern). Pure: no Redis import.

A job's own keys all start with `job_prefix`: the job's Redis ACL user may reach
those and nothing else (platform/security/redis_acl.py).
"""

from __future__ import annotations

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
    "stack_request": "job:{id}:stackreq:{rank}",
    "stacks": "job:{id}:stacks:{rank}",
    "debug_request": "job:{id}:debug:req",
    "debug_answers": "job:{id}:debug:{rid}",
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
    "audit": "audit",
}


# -- a job's own keys ----------------------------------------------------------------
def job_prefix(p: str, job_id: str) -> str:
    """What every key of the job but its record starts with."""
    return f"{p}job:{job_id}:"


def job(p: str, job_id: str) -> str:
    return f"{p}job:{job_id}"


def events(p: str, job_id: str) -> str:
    return f"{p}job:{job_id}:events"


def logs(p: str, job_id: str) -> str:
    return f"{p}job:{job_id}:logs"


def progress(p: str, job_id: str) -> str:
    return f"{p}job:{job_id}:progress"


def curve(p: str, job_id: str) -> str:
    return f"{p}job:{job_id}:curve"


def job_metrics(p: str, job_id: str) -> str:
    return f"{p}job:{job_id}:metrics"


def checkpoints(p: str, job_id: str) -> str:
    return f"{p}job:{job_id}:checkpoints"


def cancel(p: str, job_id: str) -> str:
    return f"{p}job:{job_id}:cancel"


def preempt(p: str, job_id: str) -> str:
    return f"{p}job:{job_id}:preempt"


def resize(p: str, job_id: str) -> str:
    return f"{p}job:{job_id}:resize"


def generation(p: str, job_id: str) -> str:
    return f"{p}job:{job_id}:generation"


def rejoin(p: str, job_id: str) -> str:
    return f"{p}job:{job_id}:rejoin"


def samples(p: str, job_id: str) -> str:
    return f"{p}job:{job_id}:samples"


def controller(p: str, job_id: str) -> str:
    return f"{p}job:{job_id}:controller"


def reports(p: str, job_id: str) -> str:
    return f"{p}job:{job_id}:reports"


def answer(p: str, job_id: str, report_id: str) -> str:
    return f"{p}job:{job_id}:answer:{report_id}"


def targets(p: str, job_id: str) -> str:
    return f"{p}job:{job_id}:targets"


def beat(p: str, job_id: str, rank: int) -> str:
    return f"{p}job:{job_id}:hb:{rank}"


def stack_request(p: str, job_id: str, rank: int) -> str:
    return f"{p}job:{job_id}:stackreq:{rank}"


def stacks(p: str, job_id: str, rank: int) -> str:
    return f"{p}job:{job_id}:stacks:{rank}"


def debug_request(p: str, job_id: str) -> str:
    return f"{p}job:{job_id}:debug:req"


def debug_answers(p: str, job_id: str, request_id: str) -> str:
    return f"{p}job:{job_id}:debug:{request_id}"


# -- the cluster's keys ---------------------------------------------------------------
def jobs(p: str) -> str:
    return f"{p}jobs"


def active(p: str) -> str:
    return f"{p}jobs:active"


def node_failures(p: str, name: str) -> str:
    return f"{p}node:{name}:failures"


def quarantine(p: str) -> str:
    return f"{p}quarantine"


def sched_wake(p: str) -> str:
    return f"{p}sched:wake"


def info(p: str, name: str) -> str:
    return f"{p}info:{name}"


def cluster_metrics(p: str) -> str:
    return f"{p}metrics:cluster"


# -- security -------------------------------------------------------------------------
def api_keys(p: str) -> str:
    return f"{p}auth:keys"


def revoked(p: str, token_id: str) -> str:
    return f"{p}auth:revoked:{token_id}"


def issued(p: str, job_id: str) -> str:
    return f"{p}auth:issued:{job_id}"


def auth_jobs(p: str) -> str:
    return f"{p}auth:jobs"


def job_user_secret(p: str, job_id: str) -> str:
    return f"{p}auth:jobuser:{job_id}"


def audit(p: str) -> str:
    return f"{p}audit"
