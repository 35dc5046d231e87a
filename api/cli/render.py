"""Human-readable output of the CLI."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import typer

# What a terminal would act on rather than print: C0 and C1 controls (ESC starts
# ANSI sequences that move the cursor, retitle the window or rewrite earlier
# lines) but newline and tab, and the bidirectional overrides that reorder what
# is shown. Job output and messages come from code the platform does not trust.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def terminal_safe(text: str) -> str:
    """`text` with every control character but newline and tab written as an escape."""
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def say(text: str) -> None:
    """Print a line of the human-readable output, terminal-safe."""
    typer.echo(terminal_safe(text))


def one_line(text: str) -> str:
    """`text` terminal-safe and on one line: newlines written as `\\n`, tabs as spaces."""
    return terminal_safe(text).replace("\n", "\\n").replace("\t", " ")


# A rank's token names it `{job}/rank-{N}`, and its data reader and metrics
# endpoint `{job}/rank-{N}/{module}` (platform/security/authority.py).
_RANK_MODULE = re.compile(r"^[^/\[\]]+/rank-(\d+)(?:/([A-Za-z_]+))?$")
_DECISIONS = {"allow": "ALLOWED", "deny": "DENIED"}


def audit_subject(rec: dict[str, Any]) -> str:
    """Who a record is about: `worker-N` (`worker-N/data`) for rank N of a job
    (or its module), else the principal as it is recorded: an API key's
    `name[tenant/key id]`, a driver, `token-authority`, `unverified`."""
    who = str(rec.get("principal") or "-")
    m = _RANK_MODULE.match(who)
    if m and (not rec.get("job") or who.startswith(f"{rec['job']}/")):
        return f"worker-{m.group(1)}" + (f"/{m.group(2)}" if m.group(2) else "")
    return who


def _utc(ts: Any) -> str:
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))
    except (OverflowError, OSError, ValueError):
        return "-"


def audit_line(rec: dict[str, Any]) -> str:
    """One audit record on one line, its time in UTC:
    `2024-01-15 10:23:45 | worker-3 | all_reduce | DENIED | token expired`."""
    decision = str(rec.get("decision") or "-")
    fields = (_utc(rec.get("ts")), audit_subject(rec), str(rec.get("action") or "-"),
              _DECISIONS.get(decision, decision.upper()), str(rec.get("reason") or "-"))
    return " | ".join(one_line(f) for f in fields)


def print_audit(records: list[dict[str, Any]]) -> None:
    for rec in records:
        typer.echo(audit_line(rec))


def _ts(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _loss(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, int | float) else "-"


def print_job(job: dict[str, Any]) -> None:
    p = job.get("progress") or {}
    rows = [
        ("id", job["id"]), ("name", job["name"]), ("state", job["state"]),
        ("world size", job["world_size"]), ("restarts", job["restarts"]),
        ("created", _ts(job.get("created_at"))), ("started", _ts(job.get("started_at"))),
        ("finished", _ts(job.get("finished_at"))),
        ("step", f"{p.get('step', 0)}/{p.get('total_steps') or '?'}"),
        ("loss", f"{_loss(p.get('loss'))} (initial {_loss(p.get('initial_loss'))})"),
    ]
    if isinstance(p.get("moe"), dict):
        rows.append(("experts", routing_line(p["moe"])))
    if job.get("max_replicas", 1) > job.get("min_replicas", 1):
        want = job.get("desired_replicas")
        rows.append(("replicas", f"{job.get('replicas')} (elastic {job['min_replicas']}.."
                                 f"{job['max_replicas']}" + (f", asked {want}" if want else "") + ")"))
        rows.append(("samples", f"{job.get('samples_seen', 0)} (global batch {job.get('global_batch')})"))
    if job.get("plan"):
        rows.append(("plan", plan_line(job["plan"], job.get("measured_step_s"))))
    elif isinstance(job.get("measured_step_s"), int | float):
        rows.append(("step time", f"measured {_secs(job['measured_step_s'])} s/step"))
    if job.get("goodput"):
        rows.append(("goodput", goodput_line(job["goodput"])))
    if job.get("spares"):
        rows.append(("spares", ", ".join(
            f"{s.get('node')} {s.get('state')}" + (" (standby)" if s.get("standby") else "")
            for s in job["spares"])))
    if job.get("waiting_for"):
        rows.append(("waiting for", job["waiting_for"]))
    if job.get("message"):
        rows.append(("message", job["message"].splitlines()[0]))
    for k, v in rows:
        say(f"{k:<12} {v}")
    for pl in job.get("placement") or []:
        say(f"  rank {pl['rank']:<3} {pl['node']:<12} leaf {pl['leaf']:<10} "
                   f"gpu {pl['gpu']} pid {pl['pid']}")
    for r in job.get("restart_log") or []:
        say(f"restart {r.get('restart')}    {r.get('kind', '?')}: {r.get('cause', '')}")
        say("             " + restart_timings(r))
    for r in job.get("resize_log") or []:
        took = f"{r['resize_s']:.2f}s to the first step" if "resize_s" in r else "in progress"
        say(f"resize       {r.get('from')} -> {r.get('to')} replicas ({r.get('cause')}, "
                   f"{r.get('path')}): {took}")
    ckpts = job.get("checkpoints") or []
    if ckpts:
        last = ckpts[-1]
        say(f"checkpoint   step {last['step']} at {last['path']} ({last['bytes']} bytes)")


def routing_line(moe: dict[str, Any]) -> str:
    """A mixture of experts' last logged step: `imbalance 1.8x, 12 dropped, aux loss 1.03, ...`."""
    load = moe.get("expert_load") or []
    imb = moe.get("imbalance")
    return (f"imbalance {imb:.2f}x" if isinstance(imb, int | float) else "imbalance -") + (
        f" over {len(load)} experts, {moe.get('dropped_tokens')} of {sum(load):g} assignments "
        f"dropped, aux loss {_secs(moe.get('aux_loss'))}, z-loss {_secs(moe.get('z_loss'))}")


def goodput_line(g: dict[str, Any]) -> str:
    """`ETTR 87.1% of 1.2h: lost recovery 310s, redone 120s, ...`, the largest losses first."""
    ettr, wall = g.get("ettr"), g.get("wall_s")
    if not isinstance(ettr, int | float) or not isinstance(wall, int | float):
        return f"- ({g.get('reason') or 'not known yet'})"
    lost = sorted(((s, c) for c, s in (g.get("by_cause") or {}).items()
                   if isinstance(s, int | float) and s >= 0.5), reverse=True)
    wall_text = f"{wall / 3600:.1f}h" if wall >= 3600 else f"{wall:.0f}s"
    parts = ", ".join(f"{c} {s:.0f}s" for s, c in lost[:4])
    return f"ETTR {100 * ettr:.1f}% of {wall_text}" + (f": lost {parts}" if parts else "")


def _secs(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, int | float) else "-"


def plan_line(plan: dict[str, Any], measured: Any) -> str:
    """The planner's layout for a `parallel: auto` job, its predicted and measured step time."""
    sched = plan.get("schedule", "?")
    if sched == "interleaved_1f1b":
        sched += f" v={plan.get('virtual_stages')}"
    return (f"dp={plan.get('dp')} tp={plan.get('tp')} pp={plan.get('pp')} "
            f"micro_batch={plan.get('micro_batch')} x{plan.get('num_microbatches', 1)} "
            f"zero={plan.get('zero_stage')} "
            + (f"hsdp={plan['shard_group_size']} " if plan.get("shard_group_size") else "")
            + (f"ep={plan['expert_parallel_size']} " if (plan.get("expert_parallel_size") or 1) > 1
               else "")
            + ("sp " if plan.get("sequence_parallel") else "")
            + f"recompute={'on' if plan.get('recompute') else 'off'} "
            f"schedule={sched} on {_plan_pools(plan)}, "
            f"{plan.get('memory_gb_per_gpu')} GB/GPU: predicted {_secs(plan.get('predicted_step_s'))} "
            f"s/step{_plan_split(plan)}, measured {_secs(measured)} s/step")


def _mixed(plan: dict[str, Any]) -> list[dict[str, Any]]:
    pools = plan.get("pools")
    return pools if isinstance(pools, list) and len(pools) > 1 else []


def _plan_pools(plan: dict[str, Any]) -> str:
    """`16 x h100-80gb`, or a mix's pools with each type's share of the global batch."""
    pools = _mixed(plan)
    if not pools:
        return f"{plan.get('gpus')} x {plan.get('gpu')}"
    def share(p: dict[str, Any]) -> str:
        v = p.get("share")
        return f"{v:.0%}" if isinstance(v, int | float) else "?"

    return " + ".join(f"{p.get('gpus')} x {p.get('gpu')} ({share(p)} of the batch)" for p in pools)


def _plan_split(plan: dict[str, Any]) -> str:
    """A mix's balanced and even predictions side by side."""
    if not _mixed(plan):
        return ""
    return f" (balanced {_secs(plan.get('balanced_step_s'))} s vs even {_secs(plan.get('even_step_s'))} s)"


def restart_timings(r: dict[str, Any]) -> str:
    """One line of how a recovery went: detection, path and the time of each phase."""
    parts = []
    for key, label in (("detected_after_s", "detected after"), ("teardown_s", "teardown"),
                       ("placement_s", "placement"), ("restore_s", "restore"),
                       ("first_step_s", "first step")):
        if isinstance(r.get(key), int | float):
            parts.append(f"{label} {r[key]:.2f}s")
    path = r.get("path", "?") + (" (warm spare)" if r.get("spare") else "")
    return f"path {path}; " + ", ".join(parts)


def print_jobs(jobs: list[dict[str, Any]]) -> None:
    say(f"{'ID':<28} {'NAME':<16} {'STATE':<10} {'STEP':>11} {'LOSS':>8}  CREATED")
    for j in jobs:
        p = j.get("progress") or {}
        step = f"{p.get('step', 0)}/{p.get('total_steps') or '?'}"
        say(f"{j['id']:<28} {j['name'][:16]:<16} {j['state']:<10} {step:>11} "
                   f"{_loss(p.get('loss')):>8}  {_ts(j.get('created_at'))}")


def print_events(events: list[dict[str, Any]]) -> None:
    for e in events:
        what = f"{e.get('from') or '-'} -> {e['to']}" if e.get("type") == "state" else e.get("type")
        say(f"{_ts(e.get('ts'))}  {what:<24} {e.get('message') or ''}")


def print_log_lines(lines: list[dict[str, Any]], as_json: bool) -> None:
    for rec in lines:
        if as_json:
            typer.echo(json.dumps(rec))
        else:
            rank = rec.get("rank")
            who = f"rank {rank}" if rank is not None else rec.get("module", "")
            say(f"[{who}] {rec.get('message', '')}")


def print_plan(plan, sc, shape) -> None:
    say(f"layout dp={shape.dp} tp={shape.tp} pp={shape.pp}: {len(plan.slots)} ranks on "
               f"{sc.nodes_used} node(s), {sc.leaves_used} leaf switch(es)")
    say(f"{'RANK':>5} {'DP':>4} {'STAGE':>5} {'TP':>3}  {'NODE':<14} {'LEAF':<10} GPUS")
    for s in plan.slots:
        d, rest = divmod(s.rank, shape.pp * shape.tp)
        stage, t = divmod(rest, shape.tp)
        say(f"{s.rank:>5} {d:>4} {stage:>5} {t:>3}  {s.node:<14} {s.leaf:<10} "
                   f"{','.join(map(str, s.gpus))}")
    say(f"score: tp groups split {sc.tp_groups_split}, pipelines across leaves "
               f"{sc.pipelines_across_leaves}, cross-leaf ring edges {sc.cross_leaf_ring_edges}, "
               f"cross-leaf {sc.cross_leaf_bytes / 1e6:.1f} MB/step, "
               f"cross-island {sc.cross_island_bytes / 1e6:.1f} MB/step")


def print_queues(data: dict[str, Any]) -> None:
    say(f"{'QUEUE':<16} {'GUARANTEED':>10} {'LIMIT':>6} {'IN USE':>7} {'RUNNING':>8} {'QUEUED':>7}")
    for q in data["queues"]:
        limit = "-" if q["limit_gpus"] is None else q["limit_gpus"]
        per_type = ", ".join(f"{t} {n}" for t, n in (q.get("gpu_types") or {}).items())
        say(f"{q['name']:<16} {q['guaranteed_gpus']:>10} {limit:>6} {q['gpus_in_use']:>7} "
                   f"{q['running']:>8} {q['queued']:>7}" + (f"  per type: {per_type}" if per_type else ""))


def _gpu_type(n: dict[str, Any]) -> str:
    """`h100-80gb`, `a100-80gb@0.5x` (emulated at half speed), `-` (unknown);
    `*` marks a value `kc node set` overrode."""
    text = n.get("gpu_type") or "-"
    if n.get("emulated_speed") is not None:
        text += f"@{n['emulated_speed']:g}x"
    return text + ("*" if n.get("overrides") else "")


def print_nodes(data: dict[str, Any]) -> None:
    say(f"{'NODE':<14} {'LEAF':<14} {'SPINE':<10} {'STATUS':<12} {'GPUS':>4} {'FREE':>4}  "
               f"{'TYPE':<16} {'NVLINK':<20} JOBS")
    quarantined, overridden = [], False
    measured = any(n.get("leaf_measured") for n in data["nodes"])
    for n in data["nodes"]:
        leaf = n["leaf"] + ("~" if n.get("leaf_measured") else "")
        islands = "_".join(".".join(map(str, i)) for i in n["nvlink"]) or "-"
        status = ("lost" if not n["alive"] else "draining" if n.get("draining")
                  else "quarantined" if n.get("quarantine") else "ready")
        if n.get("quarantine"):
            quarantined.append(n)
        overridden = overridden or bool(n.get("overrides"))
        say(f"{n['name']:<14} {leaf:<14} {n['spine'] or '-':<10} "
                   f"{status:<12} {n['gpus']:>4} {n['free_gpus']:>4}  "
                   f"{_gpu_type(n):<16} {islands:<20} {', '.join(n['jobs']) or '-'}")
    if measured:
        say("\n~ measured by `kc topology probe`: the node has no kc.io/leaf label")
    if overridden:
        say("\n* overridden with `kc node set` (its --clear-gpu-type and --clear-emulated-speed "
            "drop an override)")
    for n in data["nodes"]:
        for problem in n.get("problems") or ():
            say(f"\n{n['name']}: {problem}")
    for n in quarantined:
        q = n["quarantine"]
        until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(q["until"]))
        say(f"\n{n['name']} is quarantined until {until}: {q['reason']}\n"
                   f"  release it early with `kc node release {n['name']}`")
    for n in data["nodes"]:
        if n["alive"] and n.get("draining"):
            deadline = n.get("drain_deadline")
            when = "no deadline" if deadline is None else "to be killed at " + time.strftime(
                "%Y-%m-%d %H:%M:%S", time.localtime(deadline))
            say(f"\n{n['name']} is draining ({when}): nothing new is placed there, and the "
                "jobs on it checkpoint and move off")


def print_probe(result: dict[str, Any]) -> None:
    """`kc topology probe`: every pair measured, then the leaves found for the
    nodes without a `kc.io/leaf` label."""
    for p in result["pairs"]:
        say(f"{p['a']:<14} {p['b']:<14} {p['latency_us']:>9.1f} us {p['bandwidth_gbps']:>8.2f} Gbit/s")
    if not result.get("leaves"):
        say("\nno leaves measured: every node measured carries a kc.io/leaf label")
        return
    say("\nleaves found (nodes without a kc.io/leaf label), median Gbit/s inside and across:")
    for lf in result["leaves"]:
        inside, across = (f"{v:.2f}" if v is not None else "-"
                          for v in (lf["intra_gbps"], lf["inter_gbps"]))
        say(f"  {lf['leaf']:<16} inside {inside:>8}  across {across:>8}  spine {lf['spine'] or '-'}"
            f"  nodes {', '.join(lf['nodes'])}")
