"""`kc doctor`: judge an environment before training, from facts gathered elsewhere.

Pure: `doctor_probe.py` gathers the facts (this machine's versions, Redis,
Ray, one report per node, storage, ports; `doctor_store.py` an object store's, from
here and from every node); the functions here turn them into findings, each with
what is wrong and how to fix it. The seed lost three days
to an NCCL version that differed between nodes; `versions_across_nodes` is the
check that would have caught it.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Literal

from kuangchao.platform.security.object_credentials import MODE_ENV, ROLE_ENV

Status = Literal["ok", "info", "warn", "fail"]

PYTHON_MIN = (3, 11)
TORCH_RANGE = ((2, 4), (2, 15))  # as pyproject.toml pins it: >=2.4,<2.15
RAY_MIN = (2, 58)
REDIS_MIN = (6, 0)  # ACL users, which every job's workers get
SKEW_WARN_S, SKEW_FAIL_S = 0.5, 5.0
FREE_WARN_GB, FREE_FAIL_GB = 20.0, 2.0
STORE_OPS = ("write", "read", "list", "delete")  # one round trip on an object store, in order


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


_FIX_VERBS = ("create", "check", "set", "give", "allow", "use", "name", "install", "delete",
              "write", "rename", "make", "pip")
_STAGE_FIX = {
    "write": "give these credentials s3:PutObject under the prefix",
    "read": "give these credentials s3:GetObject under the prefix",
    "list": "give these credentials s3:ListBucket on the bucket for the prefix",
    "delete": "give these credentials s3:DeleteObject under the prefix (pruning old "
              "checkpoints needs it)",
}


# -- an object store (--checkpoint-path s3://...; the facts: doctor_store.py) -------------

def split_fix(text: str) -> tuple[str, str]:
    """A storage message `what is wrong; what to change` as (message, fix); fix "" without one."""
    for m in re.finditer(r"; ", text):
        tail = text[m.end():]
        if tail.split(" ", 1)[0].lower() in _FIX_VERBS:
            return text[:m.start()], tail
    return text, ""


def _ms(value: float) -> str:
    return f"{value:.1f} ms" if value < 10 else f"{value:.0f} ms"


def latency_text(ms: dict[str, float]) -> str:
    """`write 4.1 ms, read 2.0 ms, list 3.2 ms, delete 12 ms`."""
    return ", ".join(f"{op} {_ms(ms[op])}" for op in STORE_OPS if op in ms)


def here_findings(facts: dict[str, Any]) -> list[Finding]:
    """`checkpoint-store` (the probe) and `checkpoint-rw` (the round trips, latency)."""
    url = facts["url"]
    if facts.get("stage") == "probe":
        msg, fix = split_fix(facts["error"])
        return [Finding("checkpoint-store", "fail", msg,
                        fix or "check the store's endpoint and credentials, or change --checkpoint-path")]
    out = [Finding("checkpoint-store", "ok",
                   f"{url}: the bucket exists and accepts the operator's credentials")]
    if facts.get("error"):
        stage = facts["stage"]
        msg, fix = split_fix(facts["error"])
        left = f" (left {facts['left']} behind; delete it)" if facts.get("left") else ""
        out.append(Finding("checkpoint-rw", "fail",
                           f"cannot {stage} {facts.get('probe', url)} from here: {msg}{left}",
                           fix or _STAGE_FIX.get(stage, "")))
    else:
        out.append(Finding("checkpoint-rw", "ok", f"write, read, list and delete from here: "
                           f"{latency_text(facts['ms'])} (median of {facts['rounds']})"))
    return out


def nodes_findings(facts: dict[str, Any]) -> list[Finding]:
    """`checkpoint-nodes` (the summary, or why the nodes were not checked),
    `checkpoint-node` (one per node that failed), `checkpoint-cleanup`."""
    base = facts.get("base", facts.get("url"))
    if facts.get("grant_error"):
        msg, fix = split_fix(facts["grant_error"])
        return [Finding("checkpoint-nodes", "fail", f"cannot mint credentials scoped to {base} for "
                        f"the nodes (jobs' ranks would get none either): {msg}",
                        fix or f"set {ROLE_ENV}, or {MODE_ENV}=shared")]
    if facts.get("dispatch_error"):  # granted, but the tasks did not run
        return [Finding("checkpoint-nodes", "fail", facts["dispatch_error"],
                        "check the Ray cluster (`ray status`) and run `kc doctor` again")]
    shared = facts.get("scope") == "shared"
    nodes = facts.get("nodes") or []
    bad = [n for n in nodes if n.get("error")]
    good = [n for n in nodes if not n.get("error")]
    out = [_node_failure(n, shared) for n in bad]
    keys = (f"the operator's own keys ({MODE_ENV}=shared: the nodes were given them for this "
            "check, as every job's ranks are)" if shared else
            "keys scoped to that prefix, as jobs' ranks get them")
    if not nodes:
        out.append(Finding("checkpoint-nodes", "warn", "the Ray cluster has no alive node to check "
                           "the store from", "start the nodes (`ray status` lists them)"))
    elif good:
        slowest = max(good, key=lambda n: sum(n["ms"].values()))
        count = f"all {len(nodes)}" if not bad else f"{len(good)} of {len(nodes)}"
        out.append(Finding("checkpoint-nodes", "ok", f"{count} node(s) write, read, list and "
                           f"delete under {base} with {keys}; slowest {slowest['node']}: "
                           f"{latency_text(slowest['ms'])}"))
    if facts.get("release_error"):
        out.append(Finding("checkpoint-cleanup", "warn", "could not release the doctor's grant: "
                           f"{facts['release_error']}", "delete the IAM role kc-job-kc-doctor-* "
                           "by hand (the nodes' keys expire on their own)"))
    return out


def _node_failure(node: dict[str, Any], shared: bool) -> Finding:
    name, stage = node.get("node", "?"), node.get("stage", "")
    msg, fix = split_fix(node["error"])
    if stage == "answer":
        return Finding("checkpoint-node", "fail", f"node {name} {msg} (checking the store there)",
                       "check the node's raylet log (`ray status`) and that it can reach the store")
    if stage == "run":
        return Finding("checkpoint-node", "fail", f"node {name}: {msg}",
                       "check the node's raylet log; install kuangchao with s3fs on every node")
    if "refused the credentials" in msg and not shared:
        fix = ("jobs' ranks get the same kind of scoped keys: let the role kuangchao assumes act "
               f"under the prefix, set {ROLE_ENV} to one that may, or {MODE_ENV}=shared")
    elif "cannot be reached" in msg or "did not answer" in msg:
        fix = (f"the nodes use the endpoint of the operator's AWS_ENDPOINT_URL; make it reachable "
               f"from node {name} (not only from here)")
    left = f" (left {node['left']} behind)" if node.get("left") else ""
    return Finding("checkpoint-node", "fail",
                   f"node {name}: cannot {stage} {node.get('probe', '')}: {msg}{left}",
                   fix or _STAGE_FIX.get(stage, ""))
