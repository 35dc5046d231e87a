"""The kuangchao half of bench/recovery.py: the MTTR and crash-detection kills
(`kc_mttr`) and the hang (`kc_hang`), run the `kc train` way (`run_as_driver`
in a thread of the benchmark process) and read from the traces and the job
record's `restart_log` and events.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from typing import Any

from bench.harness import BenchCluster, log, median
from bench.recovery_common import (
    OURS_DEFAULTS,
    RANK,
    WAIT_S,
    Background,
    Recovery,
    Signalled,
    TraceTail,
    analyse,
    describe,
    drive_kills,
    recovery_spec,
    release,
    signal_at,
    wait_until,
)


def _store(cluster: BenchCluster):
    from kuangchao.platform.jobs.store import JobStore

    return JobStore.from_url(cluster.settings.redis_url, cluster.settings.redis_prefix)


def _find_job(store, name: str, since: float) -> str | None:
    jobs = [j for j in store.list() if j.name == name and j.created_at >= since]
    return jobs[-1].id if jobs else None


def _start_kc(cluster: BenchCluster, doc: dict[str, Any]) -> tuple[Background, str]:
    from kuangchao.platform.runtime.driver import run_as_driver

    store = _store(cluster)
    since = time.time() - 1
    run = Background(lambda: run_as_driver(doc, cluster.settings), "kc-driver")
    job_id = wait_until(lambda: _find_job(store, doc["task"]["name"], since), 60, "the job", run.alive)
    if job_id is None:
        raise TimeoutError("the kuangchao job was not submitted within 60s")
    return run, job_id


def _kc_phases(store, job_id: str, recs: list[Recovery], n_mttr: int) -> list[dict[str, Any]]:
    """Match each kill with its restart_log entry; print where the time went for the
    first `n_mttr` (the MTTR kills; the others only feed crash_detect_ms)."""
    job = store.get(job_id)
    events = store.events(job_id)
    restarts = list(job.restart_log)
    missing: set[str] = set()
    wanted = ("kind", "rank", "node", "failed_at", "detected_after_s", "teardown_s", "placement_s",
              "restore_s", "first_step_s", "resumed_step", "first_step_at", "path")
    entries = []
    splits: list[dict[str, float]] = []
    for i, r in enumerate(recs):
        end = recs[i + 1].kill.t if i + 1 < len(recs) else float("inf")
        entry = next((e for e in restarts if r.kill.t < float(e.get("failed_at", 0)) < end), None)
        if entry is None:  # fall back to the failure event
            entry = next((e for e in events if e.get("type") == "failure"
                          and r.kill.t < float(e.get("failed_at", e.get("ts", 0))) < end), None)
        entry = dict(entry or {})
        entries.append(entry)
        if i >= n_mttr:
            continue
        missing |= {k for k in wanted if k not in entry}
        t0 = r.kill.t
        marks = [("marked failed", entry.get("failed_at"))]
        for e in events:
            if t0 < e.get("ts", 0) <= r.first_step and e.get("type") != "failure":
                name = (f"{e.get('from', '')}->{e.get('to', '')}" if e.get("type") == "state"
                        else "workers started (pids recorded)" if e.get("type") == "placement"
                        else str(e.get("type")))
                marks.append((name, e["ts"]))
        marks += [("loop start", r.loop_start), ("model+data built", r.built),
                  ("checkpoint restored", r.restored), ("first step", r.first_step)]
        marks = sorted((m for m in marks if m[1] is not None), key=lambda m: float(m[1]))
        log(f"kuangchao kill {i} timeline (s after SIGKILL): "
            + ", ".join(f"{name} +{float(ts) - t0:.2f}" for name, ts in marks))
        if entry:
            log(f"kuangchao kill {i} restart_log: {json.dumps(entry, default=str)}")
        failed_at = float(entry.get("failed_at", t0))
        placed = next((e["ts"] for e in events if e.get("type") == "placement"
                       and failed_at <= e.get("ts", 0) <= r.loop_start), None)
        running = next((e["ts"] for e in events if e.get("type") == "state"
                        and e.get("to") == "RUNNING" and failed_at <= e.get("ts", 0) <= r.loop_start),
                       None)
        if "failed_at" in entry and placed is not None and running is not None:
            splits.append({"detect": failed_at - t0, "replacement started": placed - failed_at,
                           "rendezvous": running - placed, "dispatch": r.loop_start - running,
                           "model+optimizer+data": r.built - r.loop_start,
                           "restore": r.restored - r.built, "first step": r.first_step - r.restored})
    if splits:
        log("kuangchao MTTR median breakdown (s): " + ", ".join(
            f"{k} {median([d[k] for d in splits]):.2f}" for k in splits[0])
            + f"; paths {[e.get('path') for e in entries]}")
    if missing:
        log(f"restart_log lacks {sorted(missing)} (measured from the outside where needed)")
    return entries


def kc_mttr(cluster: BenchCluster, targets: list[int], steps: int, every: int,
            extra: int, ft: dict[str, Any] | None = None,
            tag: str = "kc-mttr") -> tuple[list[Recovery], list[float]]:
    """The MTTR kills, then `extra` more for crash-detection samples; returns the
    MTTR kills' recoveries and every kill's SIGKILL -> failed_at in ms.

    `ft`: overrides of kuangchao's default fault tolerance (warm spares); `tag`
    names the run's trace folder (one per run: runs repeat on one cluster).
    """
    folder = cluster.tmp / tag
    doc = recovery_spec(steps, folder, every, len(targets) + extra, "bench-recovery", ft)
    tail = TraceTail(folder)
    run, job_id = _start_kc(cluster, doc)
    store = _store(cluster)
    try:
        kills = drive_kills(tail, targets, run, extra)
        job = run.join(WAIT_S, "the kuangchao job")
    except BaseException:
        with contextlib.suppress(Exception):
            from kuangchao.platform.control import operations as jobs
            jobs.cancel(store, job_id)
        raise
    if run.error is not None:
        raise run.error
    log(f"kuangchao job {job_id} ended {job['state']} after {job['restarts']} restart(s): "
        f"{job.get('message')}")
    recs = analyse(tail, kills)
    describe("kuangchao", recs[:len(targets)])
    placed = {p["rank"]: p.get("pid") for p in job.get("placement", [])}
    log(f"kuangchao final placement pids {placed}")
    entries = _kc_phases(store, job_id, recs, len(targets))
    detect = []
    for r, e in zip(recs, entries, strict=True):
        if "failed_at" in e:
            detect.append((float(e["failed_at"]) - r.kill.t) * 1000)
        else:
            log("no failed_at for a kill; crash_detect_ms has one sample fewer")
        if "resumed_step" in e and e["resumed_step"] != r.resumed:
            log(f"restart_log resumed_step {e['resumed_step']} != traced {r.resumed}")
    for r in recs:
        if r.resumed < r.acked:
            log(f"kuangchao LOST an acknowledged checkpoint: step {r.acked} acknowledged before "
                f"the kill, resumed from {r.resumed}")
    return recs[:len(targets)], detect


def kc_hang(cluster: BenchCluster, at_step: int, every: int, bound_s: float,
            tag: str = "kc-hang") -> float | None:
    """SIGSTOP rank 1; seconds until kuangchao marks a rank failed, None if not within bound_s.

    Kuangchao at its default fault tolerance: the stopped process's heartbeat
    thread stops with it, so the rank is judged after `heartbeat_timeout_s`.
    """
    from kuangchao.platform.control import operations as jobs
    folder = cluster.tmp / tag
    doc = recovery_spec(100_000, folder, every, 1, "bench-hang")
    tail = TraceTail(folder)
    run, job_id = _start_kc(cluster, doc)
    store = _store(cluster)
    stop: Signalled | None = None
    try:
        stop = signal_at(tail, at_step, 0.0, signal.SIGSTOP, run.alive)
        log(f"  SIGSTOP rank {RANK} pid {stop.pid} after step {at_step}")
        s = stop

        def failed() -> dict[str, Any] | None:
            job = store.get(job_id)
            hit = next((e for e in job.restart_log if float(e.get("failed_at", 0)) > s.t), None)
            if hit is None and job.state.is_terminal:
                return {"failed_at": job.finished_at, "cause": job.message, "terminal": True}
            return hit
        entry = wait_until(failed, bound_s, "the hang to be detected", poll_s=0.05)
        if entry is None:
            log(f"kuangchao: hang not detected within {bound_s:.0f}s")
            return None
        log(f"kuangchao: hang detected: {json.dumps(entry, default=str)}")
        took = float(entry["failed_at"]) - stop.t
        if entry.get("last_heartbeat_at"):
            last = float(entry["last_heartbeat_at"]) - stop.t
            silence = float(entry.get("detected_after_s") or 0.0)
            log(f"kuangchao: SIGSTOP -> marked failed {took:.2f}s = last heartbeat {last:+.2f}s "
                f"+ {silence:.2f}s of silence until the verdict (heartbeat_timeout_s "
                f"{OURS_DEFAULTS['heartbeat_timeout_s']}) + {took - last - silence:.2f}s "
                "between the verdict and the recorded failure (evidence: stacks, process state)")
        return took
    finally:
        with contextlib.suppress(Exception):
            jobs.cancel(store, job_id)
        if stop is not None:
            release(stop.pid)
        with contextlib.suppress(Exception):
            run.join(120, "the cancelled kuangchao job")
