"""Building, drilling and removing the network of a netns cluster (see netplan.py).

Needs root (CAP_NET_ADMIN) and iproute2's `ip` and `tc`. Every command is
logged to `$KC_HOME/logs/netns.log`, so what a drill did can be read back.
"""

from __future__ import annotations

import fcntl
import os
import random
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kuangchao.platform.cluster.netplan import SUBNETS, NetPlan, NetworkSpec, plan_network
from kuangchao.platform.errors import ClusterError
from kuangchao.platform.settings import kc_home

LOCK = Path("/run/kc-netns.lock")  # one run at a time picks a subnet and builds on it
DRILLS = ("cut", "cut-redis", "slow", "heal")


def unavailable() -> str | None:
    """Why this process cannot build a netns cluster, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run as root or use isolation: none"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed; apt-get install iproute2"
    return None


def _log_line(text: str) -> None:
    log = kc_home() / "logs" / "netns.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"{time.strftime('%H:%M:%S')} {text}\n")


def run(cmds: list[list[str]], check: bool = True) -> list[str]:
    """Run each command; returns the errors of those that failed (raises on the first
    with `check`)."""
    errors = []
    for cmd in cmds:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        _log_line(f"{'ok ' if out.returncode == 0 else 'ERR'} {' '.join(cmd)}"
                  + (f"  # {out.stderr.strip()}" if out.returncode else ""))
        if out.returncode != 0:
            err = f"`{' '.join(cmd)}` failed: {out.stderr.strip()}"
            if check:
                raise ClusterError(err)
            errors.append(err)
    return errors


@contextmanager
def _locked() -> Iterator[None]:
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _subnets_in_use() -> set[int]:
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    return {int(m) for m in re.findall(r"inet 198\.18\.(\d+)\.\d+/", out)}


def build(spec: NetworkSpec, nodes: list[tuple[str, str]]) -> NetPlan:
    """Make the network for `nodes` ((name, leaf) pairs) on a /24 no one here uses.
    On any failure, what was made is removed again."""
    why = unavailable()
    if why:
        raise ClusterError(why)
    with _locked():
        used = _subnets_in_use()
        free = [s for s in range(SUBNETS) if s not in used]
        if not free:
            raise ClusterError("every /24 of 198.18.0.0/16 is in use; `kc down` other clusters")
        plan = plan_network(secrets.token_hex(2), random.choice(free), spec, nodes)
        try:
            run(plan.build())
        except BaseException:
            run(plan.teardown(), check=False)
            raise
    return plan


def remove(plan: NetPlan) -> None:
    """Remove every namespace, link and bridge of `plan`, and anything else tagged with
    it (a half-built run). Quiet about what is already gone."""
    run(plan.teardown(), check=False)
    for name in leftovers(plan.tag):
        run([["ip", "netns", "del", name]] if name.startswith("kc-")
            else [["ip", "link", "del", name]], check=False)


def leftovers(tag: str = "") -> list[str]:
    """Namespaces and links this machine still has that a netns cluster made
    (`tag` narrows it to one cluster)."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in ns.splitlines() if line.strip()]
    out = [n for n in names if re.match(rf"kc-{tag or '[0-9a-f]{4}'}-", n)]
    for m in re.finditer(r"^\d+: ([^:@]+)[:@]", links, re.M):
        name = m.group(1)
        if re.fullmatch(rf"kc{tag or '[0-9a-f]{4}'}[slmnuv]\d*", name):
            out.append(name)
    return out


def drill(plan: NetPlan, what: str, node: str, gbps: float | None = None) -> list[list[str]]:
    """Apply one drill (`cut`, `cut-redis`, `slow` with `gbps`, `heal`) to `node`;
    returns the commands it ran."""
    if what == "cut":
        cmds = plan.cut(node)
    elif what == "cut-redis":
        cmds = plan.cut_redis(node)
    elif what == "slow":
        if gbps is None or gbps <= 0:
            raise ClusterError("a slow drill needs a rate: --gbps, e.g. 0.1")
        cmds = plan.slow(node, gbps)
    elif what == "heal":
        run(plan.heal(node), check=False)  # each undoes a drill that may not have been done
        return plan.heal(node)
    else:
        raise ClusterError(f"unknown drill {what!r}; one of {list(DRILLS)}")
    run(cmds)
    return cmds


def netns_exec(plan: NetPlan, node: str) -> list[str]:
    """The command prefix that runs a program inside `node`'s namespace."""
    return ["ip", "netns", "exec", plan.node(node).netns]


def pids_inside(plan: NetPlan) -> set[int]:
    """Every process running in one of `plan`'s namespaces."""
    out: set[int] = set()
    for n in plan.nodes:
        listed = subprocess.run(["ip", "netns", "pids", n.netns], capture_output=True, text=True)
        out |= {int(p) for p in listed.stdout.split() if p.isdigit()}
    return out
