"""Starting the Ray side of a local stack: the head and one raylet per node.

Every raylet runs on this one machine, so what is tuned here is what many
raylets on one host need: ports of their own, no secrets in their
environment, and pollers that do not eat a small machine's CPU.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kuangchao.platform.cluster.netplan import NODE_IF, NetPlan
from kuangchao.platform.cluster.topology import (
    LABEL_LEAF,
    LABEL_ROLE,
    ClusterTopology,
    gpu_resource,
)
from kuangchao.platform.errors import ClusterError
from kuangchao.platform.runtime import procs
from kuangchao.platform.runtime.netns import netns_exec
from kuangchao.platform.runtime.ray_connect import CONTROL_CAPACITY, CONTROL_RESOURCE, ray_token_env
from kuangchao.platform.settings import kc_home, operator_storage_env

if TYPE_CHECKING:
    from kuangchao.platform.runtime.localcluster import UpOptions

OBJECT_STORE_BYTES = 128 * 1024 * 1024
# What no raylet's environment may hold, whatever the shell that ran `kc up` had.
SECRET_ENV = ("KC_REDIS_URL", "KC_REDIS_URL_FILE", "KC_SIGNING_KEY_FILE", "KC_ADMIN_KEY_FILE",
              "KC_API_KEY", "KC_METRICS_TOKEN_FILE")
# Every node of a local cluster runs on this one machine, so each of Ray's
# per-node pollers sees all of it: the dashboard agent's reporter walks every
# process on every tick, and the head's log monitor lists the session's log
# folder ten times a second. Prometheus scrapes every 15 s, so a sample every
# 15 s loses nothing, and new log files are found within 5 s; measured on an
# idle 2-node stack, the log monitor then uses 0.16 CPU-s a minute, not 0.74,
# and each dashboard agent two thirds of what it did. The shell's values win.
RAY_QUIET = {"REPORTER_UPDATE_INTERVAL_MS": "15000",
             "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0", "LOG_NAME_UPDATE_INTERVAL_S": "5"}
BIN = Path(sys.executable).parent


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ray_env(state: dict[str, Any], admin: bool = True) -> dict[str, str]:
    """The environment of what `up` starts. Only the processes `up` starts itself
    (the control plane's starter, the API) get the admin Redis URL. No raylet
    does, the head's included: every worker and driver a raylet spawns inherits
    its environment, and a rank's code can pin a task to any node. Drivers on
    this machine find the URL in `$KC_HOME/cluster.json`; ranks get their job's
    own Redis user."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env.update({k: v for k, v in RAY_QUIET.items() if k not in env})
    for secret in SECRET_ENV:
        env.pop(secret, None)

    env.update(ray_token_env(state))
    if admin:
        env["KC_REDIS_URL"] = state["redis_url"]
    else:
        # A raylet: the operator's object-store credentials stay with the API and the
        # control plane's actors (Settings.object_store_env); ranks get their job's
        # scoped ones in their grant, and botocore there finds no credentials file or
        # instance role to fall back on.
        for name in operator_storage_env():
            env.pop(name, None)
        env.update(AWS_SHARED_CREDENTIALS_FILE=os.devnull, AWS_CONFIG_FILE=os.devnull,
                   AWS_EC2_METADATA_DISABLED="true")
    env["KC_REDIS_PREFIX"] = state["redis_prefix"]
    env["KC_HOME"] = str(kc_home())
    return env


def node_env(state: dict[str, Any], topo: ClusterTopology, name: str) -> dict[str, str]:
    """A node raylet's environment: `ray_env`, plus, with `node_storage: private`, a
    folder of the node's own (`KC_NODE_DIR`) that is also the only place its ranks
    may keep checkpoints (`KC_CHECKPOINT_ROOTS`): nothing is shared between nodes."""
    env = ray_env(state, admin=False)
    if topo.node_storage == "private":
        own = kc_home() / "nodes" / name
        own.mkdir(parents=True, exist_ok=True)
        env["KC_NODE_DIR"] = env["KC_CHECKPOINT_ROOTS"] = str(own)
    return env


def ray_start(args: list[str], env: dict[str, str], log_name: str,
              prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    """`ray start` with `args`; `prefix` runs it elsewhere (`ip netns exec NS`)."""
    log = open(kc_home() / "logs" / log_name, "ab")
    # Ray's dashboard agent listens on a fixed default port (52365); a second
    # cluster on the same machine would lose its agent and with it job
    # submission, so every raylet gets a port of its own.
    return subprocess.Popen([*prefix, str(BIN / "ray"), "start", *args, "--disable-usage-stats",
                             f"--object-store-memory={OBJECT_STORE_BYTES}",
                             f"--dashboard-agent-listen-port={procs.free_port()}"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


HEAD_TRIES = 3


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return "".join(f"\n  | {line}" for line in text)


def _start_head(state: dict[str, Any], opts: UpOptions) -> int:
    """Start the Ray head; returns its GCS port.

    Where kc chose the ports, a failed start is retried on fresh ports and a
    fresh temp dir: a port free when chosen can still be taken by another
    server before Ray binds it, and a busy machine should not fail `kc up`
    for that."""
    tries = HEAD_TRIES if opts.ray_port is None else 1
    log = kc_home() / "logs" / "ray-head.log"
    plan = net_plan(state)
    # On a netns cluster the head is a host the nodes reach by its bridge address.
    host = plan.host_addr if plan else "127.0.0.1"
    where = [f"--node-ip-address={host}"] if plan else []
    for attempt in range(1, tries + 1):
        port = opts.ray_port or procs.free_port()
        dashboard_port = opts.dashboard_port or procs.free_port()
        state.update(ray_port=port, ray_address=f"{host}:{port}",
                     dashboard_url=f"http://127.0.0.1:{dashboard_port}")
        # The head takes no user work: no CPUs or GPUs for ranks, tasks or
        # drivers that ask for them, only the control plane's own resource.
        head = ray_start(["--head", f"--port={port}", f"--temp-dir={state['temp_dir']}",
                          "--num-cpus=0", "--num-gpus=0",
                          f"--resources={json.dumps({CONTROL_RESOURCE: CONTROL_CAPACITY})}",
                          f"--labels={LABEL_ROLE}=head", "--dashboard-host=127.0.0.1",
                          f"--dashboard-port={dashboard_port}",
                          f"--ray-client-server-port={procs.free_port()}", *where],
                         ray_env(state, admin=False), log.name)
        if head.wait(timeout=180) == 0:
            return port
        if attempt == tries:
            raise ClusterError(f"`ray start --head` failed {tries} time(s); the end of "
                               f"{log}:{_log_tail(log)}")
        _log(f"`ray start --head` failed (try {attempt} of {tries}, see {log}); "
             "trying again on fresh ports")
        procs.stop(procs.matching([state["temp_dir"]]))
        shutil.rmtree(state["temp_dir"], ignore_errors=True)
        state["temp_dir"] = f"/tmp/kc-{secrets.token_hex(4)}"
    raise AssertionError("unreachable")


def net_plan(state: dict[str, Any]) -> NetPlan | None:
    """The network of a netns cluster, as `up` recorded it; None on loopback."""
    return NetPlan.from_json(state["net"]) if state.get("net") else None


def start_ray(state: dict[str, Any], topo: ClusterTopology, opts: UpOptions) -> None:
    _start_head(state, opts)
    plan = net_plan(state)
    # One raylet at a time: raylets started concurrently on one machine race
    # for the same local ports and sockets and time out.
    for node in topo.nodes:
        shown = node.labels()
        if plan and not plan.spec.leaf_labels:  # left for `kc topology probe` to find
            shown.pop(LABEL_LEAF, None)
        labels = ",".join(f"{k}={v}" for k, v in shown.items())
        pinned = json.dumps({gpu_resource(g): 1 for g in range(node.gpus)})
        env, prefix, where = node_env(state, topo, node.name), (), []
        if plan:  # a host of its own: its namespace, its address, gloo on its one link
            prefix = tuple(netns_exec(plan, node.name))
            where = [f"--node-ip-address={plan.node(node.name).addr}"]
            env["GLOO_SOCKET_IFNAME"] = NODE_IF
        # Every node of this cluster writes its worker logs to the head's session
        # folder, which the head's log monitor already forwards to drivers; a
        # monitor per node would scan the same files again (and forward them
        # twice), and on a small machine their polling is a good share of the CPU.
        proc = ray_start([f"--address={state['ray_address']}", f"--num-cpus={int(node.cpus)}",
                          f"--num-gpus={node.gpus}", f"--labels={labels}",
                          f"--resources={pinned}", "--include-log-monitor=False", *where],
                         env, f"ray-{node.name}.log", prefix)
        if proc.wait(timeout=300) != 0:
            log = kc_home() / "logs" / f"ray-{node.name}.log"
            raise ClusterError(f"`ray start` for {node.name} failed; the end of {log}:"
                               f"{_log_tail(log)}")
    _log(f"ray        {state['ray_address']} (head + {len(topo.nodes)} node(s), "
         f"{topo.total_gpus} GPUs)")
    _log(f"dashboard  {state['dashboard_url']} (Ray's token auth: `export RAY_AUTH_MODE=token "
         f"RAY_AUTH_TOKEN_PATH={state['ray_token_file']}` before `ray job submit`)")
