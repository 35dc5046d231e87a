"""`kc doctor`: judge an environment before training, from facts gathered elsewhere.

Pure: `doctor_probe.py` gathers the facts (this machine's versions, Redis,
Ray, one report per node, storage, ports); the functions here turn them into
findings, each with what is wrong and how to fix it. The seed lost three days
to an NCCL version that differed between nodes; `versions_across_nodes` is the
check that would have caught it.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Literal

Status = Literal["ok", "info", "warn", "fail"]

PYTHON_MIN = (3, 11)
TORCH_RANGE = ((2, 4), (2, 15))  # as pyproject.toml pins it: >=2.4,<2.15
RAY_MIN = (2, 58)
REDIS_MIN = (6, 0)  # ACL users, which every job's workers get
SKEW_WARN_S, SKEW_FAIL_S = 0.5, 5.0
FREE_WARN_GB, FREE_FAIL_GB = 20.0, 2.0


@dataclass(frozen=True)
class Finding:
    check: str
    status: Status
    message: str
    fix: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def healthy(findings: list[Finding]) -> bool:
    """Exit 0 only when nothing is wrong: `info` (not applicable here) is fine."""
    return all(f.status in ("ok", "info") for f in findings)


def _version(text: str | None) -> tuple[int, ...]:
    nums = re.findall(r"\d+", (text or "").split("+")[0])
    return tuple(int(n) for n in nums[:3])


def local_versions(facts: dict[str, Any]) -> list[Finding]:
    """Python, torch and Ray on this machine, against what kuangchao supports."""
    out = []
    py = _version(facts.get("python"))
    out.append(Finding("python", "ok", f"Python {facts.get('python')}") if py[:2] >= PYTHON_MIN
               else Finding("python", "fail", f"Python {facts.get('python')} is too old",
                            f"use Python {'.'.join(map(str, PYTHON_MIN))} or newer"))
    torch = _version(facts.get("torch"))
    lo, hi = TORCH_RANGE
    if not torch:
        out.append(Finding("torch", "fail", "torch is not installed",
                           "pip install 'torch==2.13.0' (CPU) or the CUDA build for your driver"))
    elif not lo <= torch[:2] < hi:
        out.append(Finding("torch", "fail", f"torch {facts['torch']} is outside the supported "
                           f"range {'.'.join(map(str, lo))} to below {'.'.join(map(str, hi))}",
                           "pip install a torch within the range, e.g. torch==2.13.0"))
    else:
        out.append(Finding("torch", "ok", f"torch {facts['torch']}"))
    ray = _version(facts.get("ray"))
    out.append(Finding("ray", "ok", f"Ray {facts.get('ray')}") if ray[:2] >= RAY_MIN
               else Finding("ray", "fail", f"Ray {facts.get('ray') or 'is not installed'}"
                            f"{' is too old' if ray else ''}",
                            f"pip install 'ray[default]>={'.'.join(map(str, RAY_MIN))}'"))
    if facts.get("cuda"):
        out.append(Finding("cuda", "ok", f"CUDA {facts['cuda']} (torch build), NCCL "
                           f"{facts.get('nccl') or 'unknown'}, {facts.get('gpus', 0)} GPU(s)"))
    else:
        out.append(Finding("cuda", "info", "no CUDA here: ranks use gloo on CPU"))
    return out


def versions_across_nodes(nodes: list[dict[str, Any]]) -> list[Finding]:
    """The versions ranks depend on must match on every node; a mismatch is named
    with the nodes on each side."""
    out = []
    for key, what, fix in (
            ("python", "Python", "install the same Python on every node"),
            ("torch", "torch", "pip install the same torch build on every node"),
            ("ray", "Ray", "pip install the same Ray on every node"),
            ("cuda", "CUDA (torch build)", "install the same torch CUDA build on every node"),
            ("nccl", "NCCL", "install the same torch build (it bundles NCCL) on every node, or "
                             "point NCCL_* at one NCCL everywhere")):
        seen: dict[str, list[str]] = {}
        for n in nodes:
            if n.get(key):
                seen.setdefault(str(n[key]), []).append(str(n.get("node", "?")))
        if len(seen) > 1:
            sides = "; ".join(f"{v} on {', '.join(sorted(ns))}" for v, ns in sorted(seen.items()))
            out.append(Finding(f"{key}-match", "fail", f"{what} differs between nodes: {sides}", fix))
        elif seen:
            out.append(Finding(f"{key}-match", "ok",
                               f"{what} {next(iter(seen))} on all {len(nodes)} node(s)"))
    return out


def clock_skew(nodes: list[dict[str, Any]]) -> list[Finding]:
    """Each node's clock against this machine's (heartbeat ages and deadlines compare them)."""
    if not nodes:
        return []
    worst = max(nodes, key=lambda n: abs(n.get("skew_s", 0.0)))
    skew = abs(worst.get("skew_s", 0.0))
    msg = f"largest clock skew {skew * 1000:.0f} ms ({worst.get('node')})"
    if skew >= SKEW_FAIL_S:
        return [Finding("clock", "fail", msg, "run chrony or ntpd on every node")]
    if skew >= SKEW_WARN_S:
        return [Finding("clock", "warn", msg, "run chrony or ntpd on every node")]
    return [Finding("clock", "ok", msg)]


def redis_findings(facts: dict[str, Any]) -> list[Finding]:
    if facts.get("error"):
        where = f"Redis at {facts['url']} does not answer: " if facts.get("url") else ""
        return [Finding("redis", "fail", where + facts["error"],
                        "start Redis (or `kc up`, which starts an embedded Valkey), or set "
                        "KC_REDIS_URL to a reachable one")]
    out = []
    version = _version(facts.get("version"))
    out.append(Finding("redis", "ok", f"Redis {facts.get('version')} at {facts.get('url')}")
               if version[:2] >= REDIS_MIN else
               Finding("redis", "fail", f"Redis {facts.get('version')} is too old for ACL users",
                       f"use Redis {'.'.join(map(str, REDIS_MIN))} or newer (7 recommended)"))
    if facts.get("acl"):
        out.append(Finding("redis-acl", "ok", f"ACL users can be created (connected as "
                                              f"{facts.get('user')})"))
    else:
        out.append(Finding("redis-acl", "warn", f"cannot manage ACL users: {facts.get('acl_error')}",
                           "connect as a Redis user with +acl, or set KC_REDIS_JOB_ACL=0 (workers "
                           "then share the admin credentials)"))
    return out


def storage_findings(facts: dict[str, Any]) -> list[Finding]:
    path = facts.get("path")
    if facts.get("error"):
        return [Finding("checkpoint-storage", "fail", f"cannot write to {path}: {facts['error']}",
                        "create the folder and give this user write access, or set "
                        "checkpoint.path to a writable place")]
    free = facts.get("free_gb", 0.0)
    msg = f"{path} is writable, {free:.1f} GB free"
    if free < FREE_FAIL_GB:
        return [Finding("checkpoint-storage", "fail", msg, "free space, or move checkpoint.path")]
    if free < FREE_WARN_GB:
        return [Finding("checkpoint-storage", "warn", msg,
                        "a few checkpoints of a large model will not fit; free space or lower "
                        "checkpoint.keep_last")]
    return [Finding("checkpoint-storage", "ok", msg)]


def ray_findings(facts: dict[str, Any]) -> list[Finding]:
    if facts.get("error"):
        return [Finding("ray", "fail", f"Ray at {facts.get('address')} is not reachable: "
                        f"{facts['error']}", "start it with `kc up`, or set RAY_ADDRESS to the "
                        "head's address")]
    return [Finding("ray-cluster", "ok", f"Ray at {facts.get('address')}: "
                    f"{facts.get('nodes', 0)} node(s), {facts.get('gpus', 0):g} GPU(s)")]


def port_findings(ports: list[dict[str, Any]]) -> list[Finding]:
    out = []
    for p in ports:
        name = f"port-{p['what']}"
        if p.get("ours") is True:
            out.append(Finding(name, "ok", f"{p['what']} answers on {p['port']}"))
        elif p.get("ours") is False:
            out.append(Finding(name, "fail", f"port {p['port']} for the {p['what']} is taken by "
                               "another program", f"stop it, or pass {p['flag']} with a free port"))
        elif p.get("open"):
            out.append(Finding(name, "warn", f"port {p['port']} for the {p['what']} is in use",
                               f"pass {p['flag']} with a free port to `kc up`"))
        else:
            out.append(Finding(name, "ok", f"port {p['port']} for the {p['what']} is free"))
    return out
