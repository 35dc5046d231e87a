"""The kuangchao half of bench/resize.py: an elastic job of the built-in trainer,
shrunk by a lost node and grown by a joining one, on a `local_cluster`.

The job is the same as Ray Train's in `bench.resize_rt`: the same model, the
global batch of GLOBAL_BATCH samples in micro-batches of MICRO_BATCH (so
accumulation 2 at 3 replicas, 3 at 2), a checkpoint every CKPT_EVERY steps,
one rank per worker node (`gpus_per_rank` = the node's GPUs). It runs with
`elastic.resize: live` (the survivors keep their processes and state) or
`restart` (every resize is a checkpoint, a trip through the queue and a
restore: a full restart), to keep whichever is faster.

Times come from the job's own resize record: `first_step_at` is stamped by
rank 0 when it reports the first optimizer step at the new size, and that
report comes after an all-reduce of the step's loss (`global_mean` in
workers/trainer/loop.py; the first step of a loop always reports) that every
rank enters only once its own optimizer step is done. So the stamp is the
first step completed on EVERY rank (plus one small all-reduce), the event
Ray Train's side is stamped at too (the latest rank's trace line for it). The
clock is the same machine's as the bench's event times (the kill, just before
the signal; the join, when `ray.nodes()` first shows the node). `resize_s` in
that record is measured from the platform's decision instead (the failure
detected, or the scheduler's grow request).
"""

from __future__ import annotations

import time
from typing import Any

from bench.harness import BenchCluster, connect, log
from bench.recovery_common import wait_until
from bench.resize_common import add_node, kill_node, leaf_nodes
from bench.resize_rt import CKPT_EVERY, GLOBAL_BATCH, MICRO_BATCH, WAIT_S, resize_spec
from kuangchao.api.sdk.client import Client
from kuangchao.platform.spec.jobspec import validate_spec


def kc_spec(mode: str, gpus_per_node: int) -> dict[str, Any]:
    doc = resize_spec(100_000)  # stopped by the bench once both resizes are measured
    doc.pop("entrypoint", None)
    doc["args"] = {}
    doc["task"]["name"] = f"bench-resize-{mode}"
    doc["parallel"].update(data_parallel_size=3, micro_batch_size=MICRO_BATCH,
                           gradient_accumulation_steps=GLOBAL_BATCH // (MICRO_BATCH * 3),
                           gpus_per_rank=gpus_per_node)
    doc["training"].update(log_interval=1000)
    doc["checkpoint"].update(interval_steps=CKPT_EVERY, keep_last=2)
    doc["data"]["record_samples"] = True
    doc["fault_tolerance"] = {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 5.0,
                              "hang_timeout_s": 60.0, "max_restarts": 10}
    doc["elastic"] = {"min_replicas": 1, "max_replicas": 3, "resize": mode}
    validate_spec(doc)
    return doc


def _entry_to(client: Client, job_id: str, replicas: int, after: float) -> dict | None:
    """The resize entry to `replicas` opened after `after`, once its first step is stamped."""
    job = client.get(job_id)
    if job["state"] in ("FAILED", "CANCELLED", "SUCCEEDED"):
        raise RuntimeError(f"job {job_id} ended as {job['state']}: {job.get('message')}")
    for e in job.get("resize_log") or []:
        if e.get("to") == replicas and e.get("first_step_at") and e["requested_at"] > after - 1:
            return e
    return None


def _at(client: Client, job_id: str, replicas: int, step: int) -> dict | None:
    job = client.get(job_id)
    return job if (job["state"] == "RUNNING" and job["replicas"] == replicas
                   and job["progress"]["step"] >= step) else None


def _settled(client: Client, jid: str, size: int, t_event: float, what: str,
             event: str, after_steps: int = CKPT_EVERY, poll_s: float = 0.01) -> dict[str, Any]:
    """The resize entry to `size` replicas after the event at `t_event`, timed; then wait
    until the job trains on at that size (`after_steps` further: a checkpoint interval)."""
    entry = wait_until(lambda: _entry_to(client, jid, size, t_event), WAIT_S,
                       f"a step at {size} replicas", poll_s=poll_s)
    if entry is None:
        raise TimeoutError(f"no step at {size} replicas within {WAIT_S:.0f}s of {event}")
    times = _times(entry, t_event)
    log(f"{what}: {times}")
    step = client.get(jid)["progress"]["step"]
    wait_until(lambda: _at(client, jid, size, step + after_steps), WAIT_S,
               f"training at {size} replicas", poll_s=poll_s)
    return times


def kc_resize(cluster: BenchCluster, mode: str, warmup_steps: int = CKPT_EVERY + 2,
              events: tuple[str, ...] = ("shrink", "grow"),
              out: dict[str, Any] | None = None, after_steps: int = CKPT_EVERY,
              poll_s: float = 0.01) -> dict[str, Any]:
    """Shrink (kill the node of the highest rank) then grow (a node joins), or only the
    `events` named; what the job's record says. Results go into `out` as they come,
    so a caller keeps the events measured before a failure. After each resize the job
    trains `after_steps` more at the new size; the job record is read every `poll_s`
    (its stamps, not the poll, time the resize: a longer period only saves the API's
    CPU, which the quick mode does)."""
    connect(cluster)
    client = Client(cluster.settings.api_url, cluster.settings.api_key)
    gpus = int(leaf_nodes()[0]["Resources"].get("GPU", 1))
    job = client.submit(kc_spec(mode, gpus))
    jid = job["id"]
    out = {} if out is None else out
    out.update(mode=mode, job=jid)
    size = len(leaf_nodes())  # one replica per worker node
    try:
        running = wait_until(lambda: _at(client, jid, size, warmup_steps), WAIT_S,
                             f"{warmup_steps} steps at {size} replicas", poll_s=poll_s)
        if running is None:
            raise TimeoutError(f"the job did not reach {warmup_steps} steps at {size} replicas "
                               f"within {WAIT_S:.0f}s")
        if "shrink" in events:
            victim = max(running["placement"], key=lambda p: p["rank"])
            t_kill = kill_node(victim["node_id"])
            log(f"kc {mode}: SIGKILL raylet of {victim['node']} at step {running['progress']['step']}")
            size -= 1
            out["shrink"] = _settled(client, jid, size, t_kill, f"kc {mode} shrink", "the kill",
                                     after_steps, poll_s)
        if "grow" in events:
            name = f"node-{len(leaf_nodes(alive=False))}"
            _, t_join = add_node(cluster, name, cpus=int(leaf_nodes()[0]["Resources"]["CPU"]),
                                 gpus=gpus)
            size += 1
            out["grow"] = _settled(client, jid, size, t_join, f"kc {mode} grow", "the join",
                                   after_steps, poll_s)
        out.update(audit_samples(client, jid))
        final = client.get(jid)
        out["restarts"] = final["restarts"]
        out["paths"] = [e.get("path") for e in final["resize_log"]]
    finally:
        client.cancel(jid)
        wait_until(lambda: client.get(jid)["state"] in ("CANCELLED", "FAILED", "SUCCEEDED"),
                   WAIT_S, "the job to stop", poll_s=poll_s)
    return out


def _times(entry: dict[str, Any], t_event: float) -> dict[str, Any]:
    return {"resize_s": round(entry["first_step_at"] - t_event, 3),
            "decision_s": entry.get("resize_s"), "cause": entry.get("cause"),
            "path": entry.get("path")}


def audit_samples(client: Client, job_id: str) -> dict[str, Any]:
    """Samples missing from, or trained twice in, the steps the job has fully recorded.

    The newest recorded step may still be half written (ranks record it one by
    one), so the audit covers the steps before it.
    """
    record = client.samples(job_id)["samples"]
    per_step: dict[int, list[int]] = {}
    layouts: dict[int, set[int]] = {}
    for field, value in record.items():
        step, dp, _ = map(int, field.split("/"))
        layouts.setdefault(step, set()).add(dp)
        for span in value.split(","):
            a, b = map(int, span.split(":"))
            per_step.setdefault(step, []).extend(range(a, b))
    last = max(per_step) if per_step else 0
    seen = [i for s in range(last) for i in per_step.get(s, [])]
    expected = set(range(last * GLOBAL_BATCH))
    return {"audited_steps": last, "samples_lost": len(expected - set(seen)),
            "samples_repeated": len(seen) - len(set(seen)),
            "steps_at_two_sizes": sum(1 for s in range(last) if len(layouts.get(s, ())) > 1),
            "sizes": sorted({d for s in range(last) for d in layouts.get(s, ())})}


def timed(fn, *args: Any, **kw: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    return fn(*args, **kw), time.monotonic() - t0
