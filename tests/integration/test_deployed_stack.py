"""A cluster started the way docker-compose and the Helm chart start it, not by
`kc up`: `ray start --head`, workers through `kc node join --block`, the control
plane through `kc control-plane start --watch`, the API as its own process, with
a signing key and an admin key from files (the deployment's Secrets).

On it: the admin key works and rotating it revokes the old one; `ray job
submit -- kc train` registers the job, `ray job stop` cancels it with its
workers gone; the watch brings a killed control-plane actor back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kuangchao.api.sdk.client import ApiError, Client
from kuangchao.platform.runtime import procs
from kuangchao.platform.runtime.ray_connect import CONTROL_CAPACITY, CONTROL_RESOURCE
from kuangchao.platform.security.apikeys import new_key
from kuangchao.platform.security.tokens import generate_key, private_pem

from .conftest import ROOT, redis_prefix, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.own_stack]
BIN = Path(sys.executable).parent
STORE = 128 * 1024 * 1024  # object store per raylet, as `kc up` gives them: the ranks need little


class Deployed:
    def __init__(self, home: Path, env: dict[str, str], head: str, dashboard: str,
                 api_url: str, admin_key: str, temp_dir: str) -> None:
        self.home, self.env, self.head, self.dashboard = home, env, head, dashboard
        self.api_url, self.admin_key, self.temp_dir = api_url, admin_key, temp_dir
        self.client = Client(api_url, admin_key)
        self.procs: list[subprocess.Popen] = []

    def spawn(self, args: list[str], log: str, env: dict[str, str] | None = None
              ) -> subprocess.Popen:
        out = open(self.home / f"{log}.log", "ab")
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=env or self.env, start_new_session=True)
        self.procs.append(proc)
        return proc

    def raylet(self, args: Callable[[], list[str]], log: str,
               env: dict[str, str] | None = None) -> None:
        """Start a `--block` raylet and wait until it is up. A raylet that times out
        at start on a loaded machine (its own `ray start` gives up) is started once
        more, with fresh ports; a second failure fails the test with its log."""
        for attempt in (1, 2):
            proc = self.spawn(args(), log, env)
            wait_for(lambda p=proc: "block forever" in self.log(log) or p.poll() is not None,
                     240, f"{log} to start")
            if proc.poll() is None:
                return
            assert attempt == 1, f"{log} did not start twice:\n{self.log(log)}"
            try:  # what the failed start left behind (its GCS or raylet) goes with it
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            (self.home / f"{log}.log").rename(self.home / f"{log}-failed.log")

    def log(self, name: str) -> str:
        return (self.home / f"{name}.log").read_text(errors="replace")[-4000:]

    def ray(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "ray"), *args], capture_output=True, text=True,
                              env=self.env, cwd=ROOT, timeout=timeout)


def _write_private(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def deployed(tmp_path_factory) -> Iterator[Deployed]:
    home = tmp_path_factory.mktemp("deployed")
    port, dash = procs.free_port(), procs.free_port()
    temp_dir = f"/tmp/kcd-{uuid.uuid4().hex[:8]}"
    key, _ = new_key("x", "default", "admin")
    with redis_prefix("kctest-deploy") as (url, prefix):
        env = {**os.environ, "KC_HOME": str(home), "KC_REDIS_PREFIX": prefix,
               "RAY_USAGE_STATS_ENABLED": "0",
               "KC_SIGNING_KEY_FILE": _write_private(home / "signing.pem",
                                                     private_pem(generate_key()).decode()),
               "KC_ADMIN_KEY_FILE": _write_private(home / "admin-key", key + "\n"),
               "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        for k in ("KC_API_URL", "KC_DEV_MODE", "RAY_ADDRESS", "KC_RAY_ADDRESS", "KC_API_KEY"):
            env.pop(k, None)
        # Ray's token authentication, as compose and the chart turn it on: every
        # raylet, driver and client presents the token.
        env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": _write_private(
            home / "ray-token", uuid.uuid4().hex + uuid.uuid4().hex)})
        env.pop("RAY_AUTH_TOKEN", None)
        # The control plane's starter and the API hold the admin URL and the keys;
        # no raylet does, the head's included (its workers and drivers inherit its
        # environment): drivers read the admin URL from a file, as on the chart's head.
        admin_env = {**env, "KC_REDIS_URL": url}
        raylet_env = {k: v for k, v in env.items() if k not in ("KC_SIGNING_KEY_FILE",
                                                                 "KC_ADMIN_KEY_FILE")}
        head_env = {**raylet_env, "KC_REDIS_URL_FILE": _write_private(home / "redis-url", url)}
        worker_env = raylet_env
        api_port = procs.free_port()
        d = Deployed(home, admin_env, f"127.0.0.1:{port}", f"http://127.0.0.1:{dash}",
                     f"http://127.0.0.1:{api_port}", key, temp_dir)
        try:
            d.raylet(lambda: [str(BIN / "ray"), "start", "--head", f"--port={port}",
                              "--num-gpus=0", "--num-cpus=0",
                              f"--resources={json.dumps({CONTROL_RESOURCE: CONTROL_CAPACITY})}",
                              f"--temp-dir={temp_dir}",
                              "--labels=kc.io/role=head", "--dashboard-host=127.0.0.1",
                              f"--dashboard-port={dash}", f"--object-store-memory={STORE}",
                              f"--dashboard-agent-listen-port={procs.free_port()}",
                              f"--ray-client-server-port={procs.free_port()}",
                              "--disable-usage-stats", "--block"], "head", head_env)
            for i in range(2):
                # One raylet at a time: raylets starting together on one machine race
                # for local ports and time out (on separate hosts they do not).
                d.raylet(lambda i=i: [
                    str(BIN / "kc"), "node", "join", "--address", d.head, "--name", f"dnode-{i}",
                    "--leaf", f"leaf-{i}", "--gpus", "4", "--nvlink", "0.1_2.3", "--cpus", "2",
                    f"--ray-arg=--dashboard-agent-listen-port={procs.free_port()}",
                    f"--ray-arg=--object-store-memory={STORE}", "--block"], f"worker-{i}",
                    worker_env)
            d.spawn([str(BIN / "kc"), "control-plane", "start", "--address", d.head,
                     "--wait-nodes", "3", "--watch", "1"], "control-plane")
            d.spawn([sys.executable, "-m", "kuangchao.api.server", "--port", str(api_port)],
                    "api", {**admin_env, "KC_RAY_ADDRESS": d.head})
            wait_for(lambda: _answers(d.client), 240, "the API and the control plane")
            wait_for(lambda: len(d.client.nodes()["nodes"]) == 2, 120, "two registered nodes")
            yield d
        finally:
            for p in d.procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
            procs.stop(procs.matching([temp_dir, f"--address={d.head}", f"--address {d.head}"]))
            for p in d.procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)


def _answers(client: Client) -> bool:
    try:
        return client.whoami()["role"] == "admin" and "queues" in client.queues()
    except (ApiError, OSError):
        return False


def test_the_deployment_admin_key_works_and_rotating_it_revokes_the_old(deployed):
    assert deployed.client.whoami()["name"] == "deploy-admin"
    nodes = {n["name"]: n for n in deployed.client.nodes()["nodes"]}
    assert set(nodes) == {"dnode-0", "dnode-1"}, "the head must not be offered for ranks"
    assert nodes["dnode-1"]["leaf"] == "leaf-1" and nodes["dnode-1"]["nvlink"] == [[0, 1], [2, 3]]
    new, _ = new_key("x", "default", "admin")
    path = deployed.home / "admin-key-2"
    _write_private(path, new)
    again = subprocess.run([str(BIN / "kc"), "control-plane", "start", "--address", deployed.head,
                            "--admin-key-file", str(path)], capture_output=True, text=True,
                           env=deployed.env, timeout=300)
    assert again.returncode == 0, again.stderr
    assert Client(deployed.api_url, new).whoami()["role"] == "admin"
    with pytest.raises(ApiError) as err:
        deployed.client.whoami()
    assert err.value.status == 401 and "revoked" in str(err.value.detail)
    deployed.client = Client(deployed.api_url, new)


def test_bad_configuration_is_refused_with_the_setting_to_change(deployed, tmp_path):
    env = {**deployed.env, "KC_SIGNING_KEY_FILE": str(tmp_path / "missing.pem")}
    out = subprocess.run([str(BIN / "kc"), "control-plane", "start", "--address", deployed.head],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2 and "KC_SIGNING_KEY_FILE" in out.stderr
    assert "Traceback" not in out.stderr
    (tmp_path / "bad-key").write_text("kc_not_a_key\n")
    env = {**deployed.env, "KC_ADMIN_KEY_FILE": str(tmp_path / "bad-key")}
    out = subprocess.run([str(BIN / "kc"), "control-plane", "start", "--address", deployed.head],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2 and "kc_<16 lowercase hex>" in out.stderr


def test_ray_job_stop_cancels_the_training_job_and_its_workers_go(deployed):
    name = f"rjs-{uuid.uuid4().hex[:6]}"
    sub = deployed.ray("job", "submit", "--address", deployed.dashboard, "--no-wait",
                       "--working-dir", "examples", "--", "kc", "train", "--config",
                       "tiny-gpt.yaml", "--set", "training.steps=100000",
                       "--set", f"task.name={name}", "--set", "model.d_model=32",
                       "--set", "data.max_bytes=200000", "--set", "checkpoint.interval_steps=1000")
    assert sub.returncode == 0, sub.stdout[-2000:] + sub.stderr[-2000:]
    ray_job = next(w.strip("'\"") for line in sub.stdout.splitlines() if "submitted" in line
                   for w in line.split() if w.strip("'\"").startswith("raysubmit_"))

    def running():
        mine = [j for j in deployed.client.list() if j["name"] == name]
        return (mine and mine[0]["state"] == "RUNNING" and mine[0]["progress"]["step"] > 0
                and all(p.get("pid") for p in mine[0]["placement"]) and mine[0])
    job = wait_for(running, 300, f"{name} to train")
    assert job["driver"] == "external" and job["owner"] == f"ray-job/{ray_job}"
    pids = [p["pid"] for p in job["placement"]]
    assert pids and all(procs.alive(p) for p in pids)

    stop = deployed.ray("job", "stop", "--address", deployed.dashboard, ray_job)
    assert stop.returncode == 0, stop.stdout[-2000:] + stop.stderr[-2000:]
    done = wait_for(lambda: (j := deployed.client.get(job["id"]))["state"] in
                    {"CANCELLED", "FAILED", "SUCCEEDED"} and j, 120, "the job to end")
    events = deployed.client.events(job["id"])["events"]
    assert done["state"] == "CANCELLED", events[-1]
    assert any("ray job stop" in (e.get("reason") or e.get("message") or "") for e in events), events
    wait_for(lambda: not any(procs.alive(p) for p in pids), 60, "the ranks' processes to exit")
    status = deployed.ray("job", "status", "--address", deployed.dashboard, ray_job)
    assert "was stopped" in status.stdout, status.stdout
    logs = deployed.ray("job", "logs", "--address", deployed.dashboard, ray_job)
    assert f"job {job['id']} submitted" in logs.stdout and "Traceback" not in logs.stdout


def test_the_watch_brings_a_killed_control_plane_actor_back(deployed):
    code = ("import ray,sys; ray.init(address=sys.argv[1], namespace='kuangchao', "
            "logging_level='ERROR'); a=ray.get_actor('kc-scheduler'); "
            "print(ray.get(a.__ray_ready__.remote()) is None); ray.kill(a, no_restart=True)")
    out = subprocess.run([sys.executable, "-c", code, deployed.head], capture_output=True,
                         text=True, env=deployed.env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    wait_for(lambda: "kc-scheduler gone" in deployed.log("control-plane"), 60,
             "the watch to notice")
    wait_for(lambda: "up again" in deployed.log("control-plane"), 120, "the control plane back")
    job = deployed.client.submit({"task": {"name": "after-watch"},
                                  "model": {"type": "gpt", "n_layers": 1, "n_heads": 2,
                                            "d_model": 32, "seq_len": 32},
                                  "data": {"max_bytes": 200_000},
                                  "parallel": {"data_parallel_size": 2, "micro_batch_size": 4},
                                  "training": {"steps": 4, "log_interval": 2},
                                  "checkpoint": {"interval_steps": 100,
                                                 "path": str(deployed.home / "ckpt")}})
    done = wait_for(lambda: (j := deployed.client.get(job["id"]))["state"] in
                    {"SUCCEEDED", "FAILED", "CANCELLED"} and j, 300, "the job to end")
    assert done["state"] == "SUCCEEDED", done
