"""Heartbeats at scale: 16,384 and 131,072 ranks beating at 1 Hz through node agents into one Redis.

The design measured (issue 30): one node agent per node of 8 ranks gathers its
ranks' beats and writes ONE record a second for the node
(`{prefix}job:{id}:nb:{node}`, `encode_node_record`, PX = the heartbeat timeout);
the controller reads the node records instead of one key per rank. Baseline:
the per-rank-key design (every rank SETs its own key, the controller MGETs them
all), measured in the same run.

What is simulated:

* Ranks and agents. `--writers` (4) forked processes each own a contiguous
  shard of whole nodes (bench/heartbeats_sim.py). Each second is cut into 20
  ticks so the writes spread evenly over the second. The writers run in one of
  two modes, switched while they run:
  - node agents: each node's agent, on a Redis connection of its own by
    default (`--agent-connections` lowers that), sends once a second what
    `workers/runtime/node_agent.py`'s `relay_once` sends in its one round trip:
    `SET nb:{node} <encode_node_record(its ranks' beats)> PX 10000`, `SMEMBERS`
    of the job's fence set, and one `MGET` of the job's three carried flags and
    the stack request of each rank it relays. Like the real agent it relays a
    rank's beat only while the rank rewrote it within two periods: a dead
    rank's frozen beat is relayed for 2 s more, then left out, and the
    controller reads the rank's own key from the next scan on (there is none:
    the rank died). A dead agent writes nothing more, its record expires, and
    its ranks fall back to their own keys (which the controller does not read:
    they are covered by a lost agent, `RelayView`). Rank 0 also sends its own
    `HSET` of the job's progress (not the agent's to carry).
  - per-rank keys: every rank beats its own key, on a connection of its own by
    default (`--connections` lowers that), exactly what
    `workers/runtime/heartbeat.py` sends in its one round trip (`SISMEMBER` of
    its process in the fence set, `SET hb:{rank} <Beat.encode()> PX 10000`,
    `GET stackreq:{rank}`, `EXISTS` of the three flags, and on rank 0 the
    job's progress `HSET`); dead ranks stop beating.
  Misbehaving, chosen with fixed seeds: 4 dead ranks (from 1.5 s), 4 hung
  ranks (beats go on, step and `progress_ts` frozen, phase `collective`), 2
  slow-start ranks (phase `init`, frozen progress: must NOT be flagged), and 2
  dead agents (from 1.5 s; all 16 of their ranks must be flagged `expired`).
* The controller. Each design's scan runs in a forked process of its own
  (bench/heartbeats_nodes.py `Controller`), so each heap holds only its own
  design's state as a real controller's would, driven scan by scan from this
  process every 0.5 s (`JobController.poll_s`; back to back when a scan takes
  longer). With agents: `read_relayed` (node records and the own keys of the
  ranks `RelayView.direct_ranks` names, pipelined MGETs in one round trip,
  parse caches kept between scans), `RelayView.update`, `BeatTable.observe`;
  per-rank: `read_beats` + `Classifier.observe`; both classifiers with each
  rank's placed pid, as `RankWatch` builds its own. Heartbeat timeout 10 s (the
  spec default), hang timeout shortened to 5 s so hangs show up within the
  run. The node-agent classifier must flag exactly the dead ranks and the
  dead agents' ranks (expired) and the hung ones (hung), over the run and in
  its last scan, else the script exits 1 (as it does when a design's writes
  fall below 95% of their nominal rate). The import-time heap is frozen out of
  the GC's way first (the controller processes inherit that).
* Redis. A private `redis-server` on a free port (no persistence, bind
  127.0.0.1, maxclients raised for the connections), stopped at the end;
  without the binary, the shared Redis at KCBENCH_REDIS_URL with a unique key
  prefix (Redis CPU then includes whatever else uses it).

Phases (3 s idle first, for Redis's idle CPU on stderr):

1. `--ranks` (16,384; 2,048 agents). The same writer processes switch between
   the two designs: 2 s of warm-up with agents, then 4 x (1 s settle + 4 s of
   per-rank keys with the per-rank scan; 1 s settle + `--seconds`/4 with node
   agents and the node-agent scan), so drift favours neither side. The
   settles (one beat period, untimed) let the writers' switch take effect.
2. `--ranks-big` (131,072; 16,384 agents). The writers simulate the agents
   only: 131,072 per-rank beats a second from Python writer processes would
   take more than this 2-core machine has. The per-rank baseline scans 131,072
   own keys that this process wrote before the phase, half of them rewritten
   (untimed) before each scan, so half the values change between scans as with
   1 Hz beats; the agents keep writing meanwhile. 2 s warm-up, then 3 x (4 s
   of baseline scans, 1 s settle + `--seconds-big`/3 of node-agent scans). A
   breakdown of the node-agent scan (6 scans) and a cProfile of it (3) follow,
   on stderr.

Reported (each the median over its segments, their min and max in `spread`):

  heartbeat_scan_ms_p99      p99 of one controller scan at 16,384 ranks with node agents;
                             baseline: the per-rank-key scan in the same run; target ours <= 100 ms
  redis_cpu_fraction         Redis CPU (INFO cpu, user + sys) over wall time at 16,384 ranks
                             with node agents (2,048 round trips a second + the scans); baseline:
                             the per-rank-key design (16,384 beats a second + its scans);
                             target ours <= 0.5 cores
  heartbeat_scan_ms_p99_131k p99 of one controller scan at 131,072 ranks with node agents;
                             baseline: read_beats + observe over 131,072 own keys; target ours
                             <= 250 ms

Stderr also gives each scan's CPU time, its parts, the GC pauses, the achieved
write rates, and who used the CPUs (writers, controller, Redis, the machine).

Layout: the writers (ranks and agents) and the private redis-server are in
bench/heartbeats_sim.py; the controller's scans, its processes, the static
baseline keys, the scan's breakdown and the measurements in
bench/heartbeats_nodes.py; the phases, checks and metrics here.

Run: .venv/bin/python bench/heartbeats.py [--seconds 25] [--ranks 16384] [--ranks-big 131072]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlparse

import redis

from kuangchao.platform.jobs import redis_client
from kuangchao.platform.jobs.store import JobStore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` when run as a script

from bench.heartbeats_nodes import (  # noqa: E402
    POLL_S,
    AgentScan,
    Controller,
    Load,
    RankScan,
    StaticRanks,
    combined,
    measure,
    percentile,
    poll_loop,
)
from bench.heartbeats_sim import (  # noqa: E402
    AGENTS,
    DEAD,
    DEAD_AFTER_S,
    DEAD_AGENTS,
    HEARTBEAT_TIMEOUT_S,
    HUNG,
    JOB,
    PER_RANK,
    RANKS_PER_NODE,
    SLOW_INIT,
    WARMUP_S,
    Writers,
    delete_keys,
    pick_dead_agents,
    pick_roles,
    raise_fd_limit,
    redis_server,
)
from bench.report import emit, log, median, wait_for_quiet  # noqa: E402
from kuangchao.platform.jobs import keys
from kuangchao.platform.jobs.flags import carried_flags

BENCH = "heartbeats"
MIN_RATE = 0.95  # achieved writes/s below this share of the nominal rate fails the run


@dataclass(frozen=True)
class Plan:
    """The run's sizes and times (main() fills it from the arguments)."""

    ranks: int
    ranks_big: int
    writers: int
    connections: int  # per-rank keys, over all writers (phase 1)
    agent_connections: int  # phase 1
    agent_connections_big: int  # phase 2
    seconds: float  # node-agent scans at `ranks`, over all segments
    seconds_big: float
    segments: int = 4
    segments_big: int = 3
    base_s: float = 4.0  # each baseline segment
    settle_s: float = 1.0  # after each switch of the writers' mode (one beat period), untimed
    timeout_s: float = HEARTBEAT_TIMEOUT_S
    hang_s: float = 5.0  # spec default 300 s; shortened so hung ranks are caught in the run
    idle_s: float = 3.0  # Redis CPU measured idle, for reference (stderr)

    def phase_s(self, big: bool) -> float:
        """Wall seconds of a phase after the writers start."""
        if big:
            return WARMUP_S + self.segments_big * (self.settle_s + self.base_s) + self.seconds_big
        return WARMUP_S + self.segments * (2 * self.settle_s + self.base_s) + self.seconds


def expected_verdicts(roles: dict[int, int], dead_agents: list[int]) -> dict[int, str]:
    want = {r: "expired" if role == DEAD else "hung" for r, role in roles.items() if role in (DEAD, HUNG)}
    for node in dead_agents:
        want.update({r: "expired" for r in range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE)})
    return want


def check_verdicts(ctl: Controller, roles: dict[int, int], dead_agents: list[int], label: str) -> bool:
    """Did the node-agent classifier flag exactly the dead ranks and the dead agents'
    ranks (expired) and the hung ranks (hung), over the run and in its last scan?"""
    want = expected_verdicts(roles, dead_agents)
    first, got_final = ctl.call("verdicts")
    got_ever = {r: kind for r, (kind, _) in first.items()}
    shown = [r for r, role in roles.items() if role in (DEAD, HUNG)]
    shown += [n * RANKS_PER_NODE for n in dead_agents]  # one rank of each dead agent
    for r in sorted(shown):
        role = roles.get(r)
        what = "dead agent's rank" if role is None else "dead rank" if role == DEAD else "hung rank"
        log(f"  {label} {what} {r}: {first[r][0]} after {first[r][1]:.1f}s" if r in first
            else f"  {label} {what} {r}: not flagged")
    ok = got_ever == want and got_final == want
    if not ok:
        def differ(got: dict[int, str]) -> str:
            missed = {r: k for r, k in want.items() if got.get(r) != k}
            extra = sorted(r for r in got if r not in want)
            return f"missed {missed or 'none'}, {len(extra)} others flagged {extra[:10]}"

        log(f"{label} CLASSIFIER CHECK FAILED: expected {want}; over the run: {differ(got_ever)}; "
            f"in the last scan: {differ(got_final)}")
    else:
        log(f"{label}: the node-agent classifier flagged exactly the {len(want)} ranks "
            f"(dead ranks, the {len(dead_agents)} dead agents' ranks, hung ranks); slow-start ranks "
            f"{sorted(r for r, x in roles.items() if x == SLOW_INIT)} untouched")
    return ok


@dataclass
class Phase:
    """What one phase measured."""

    label: str
    ranks: int
    roles: dict[int, int]
    ours_runs: list[list[float]] = field(default_factory=list)  # scan seconds per segment
    base_runs: list[list[float]] = field(default_factory=list)
    ours_windows: list[Load] = field(default_factory=list)
    base_windows: list[Load] = field(default_factory=list)
    ours_parts: list[tuple] = field(default_factory=list)  # (read_relayed, merge, observe) s
    base_parts: list[tuple] = field(default_factory=list)  # (read_beats, observe) s
    ours_cpu: list[float] = field(default_factory=list)  # each scan's CPU seconds
    base_cpu: list[float] = field(default_factory=list)
    gc_gen2: list[float] = field(default_factory=list)  # the node-agent controller's
    gc_total: float = 0.0
    base_gc_gen2: list[float] = field(default_factory=list)
    split: dict[str, float] = field(default_factory=dict)
    ok: bool = False
    lag: float = 0.0
    skipped: int = 0
    load_avg: float = 0.0

    def p99s(self, runs: list[list[float]]) -> list[float]:
        return [percentile(run, 99) * 1e3 for run in runs]


def timed_segment(phase: Phase, ctl: Controller, seconds: float, stats: redis.Redis,
                  writers: Writers, ours: bool, before: Callable[[], None] | None = None) -> None:
    """`seconds` of one design's scans, measured."""
    n0 = len(ctl.parts)
    ctl.call("gc")
    with measure(stats, writers, ctl.pid) as window:
        times = poll_loop(ctl.scan, seconds, min_scans=3, check=writers.check_alive, before=before)
    gen2, total = ctl.call("gc")
    if ours:
        phase.ours_runs.append(times)
        phase.ours_windows += window
        phase.ours_parts += ctl.parts[n0:]
        phase.ours_cpu += ctl.cpu[n0:]
        phase.gc_gen2 += gen2
        phase.gc_total += total
    else:
        phase.base_runs.append(times)
        phase.base_windows += window
        phase.base_parts += ctl.parts[n0:]
        phase.base_cpu += ctl.cpu[n0:]
        phase.base_gc_gen2 += gen2


def finish(phase: Phase, ours: Controller, writers: Writers, dead_agents: list[int]) -> None:
    """The breakdown of our scan, the checks and the writers' lateness."""
    phase.split = ours.call("breakdown")
    writers.check_alive()
    phase.ok = check_verdicts(ours, phase.roles, dead_agents, phase.label)
    phase.lag, phase.skipped = max(writers.shared.lag), sum(writers.shared.skipped)
    phase.load_avg = os.getloadavg()[0]


def agent_scan(url: str, prefix: str, ranks: int, plan: Plan) -> Callable[[], AgentScan]:
    return lambda: AgentScan(redis_client.connect(url), prefix, ranks, plan.timeout_s, plan.hang_s)


def rank_scan(url: str, prefix: str, ranks: int, plan: Plan) -> Callable[[], RankScan]:
    return lambda: RankScan(redis_client.connect(url), prefix, ranks, plan.timeout_s, plan.hang_s)


# -- the phases ----------------------------------------------------------------------

def phase_writers(plan: Plan, ctx: mp.context.BaseContext, url: str, stats: redis.Redis,
                  prefix: str, ranks: int, connections: int, agent_connections: int
                  ) -> tuple[Phase, list[int], Writers]:
    """A phase's misbehaving ranks and dead agents (fixed seeds), and its writers (not
    started), in node-agent mode."""
    roles = pick_roles(ranks)
    dead_agents = pick_dead_agents(ranks, roles)
    host, port = urlparse(url).hostname or "127.0.0.1", urlparse(url).port or 6379
    p = JobStore(stats, prefix).p
    writers = Writers(ctx, ranks, plan.writers, roles, dead_agents, host, port, prefix,
                      connections, agent_connections,
                      list(carried_flags(p, JOB).values()), keys.fenced(p, JOB),
                      keys.progress(p, JOB), plan.timeout_s, AGENTS)
    return Phase(f"{ranks:,} ranks", ranks, roles), dead_agents, writers


def warm_up(writers: Writers, ours: Controller, stats: redis.Redis) -> None:
    """Connect the writers, start them in node-agent mode, and scan through the warm-up."""
    took = writers.start()
    log(f"writers connected in {took:.1f}s; "
        f"{stats.info('clients')['connected_clients']} Redis clients")
    writers.go()
    ours.start()
    poll_loop(ours.scan, WARMUP_S, check=writers.check_alive)


def phase_mixed(plan: Plan, ctx: mp.context.BaseContext, url: str, stats: redis.Redis,
                prefix: str) -> Phase:
    """Phase 1: the same writers alternate between node agents and per-rank keys."""
    ranks = plan.ranks
    phase, dead_agents, writers = phase_writers(plan, ctx, url, stats, prefix, ranks,
                                                plan.connections, plan.agent_connections)
    ours_s = plan.seconds / plan.segments
    log(f"phase 1: {ranks:,} ranks on {ranks // RANKS_PER_NODE:,} nodes from {plan.writers} writer "
        f"processes; node agents on {plan.agent_connections:,} connections, per-rank keys on "
        f"{plan.connections:,}; {plan.segments} x ({plan.settle_s:.1f}s settle + {plan.base_s:.1f}s "
        f"per-rank, {plan.settle_s:.1f}s settle + {ours_s:.1f}s node agents)")
    ours = Controller(ctx, agent_scan(url, prefix, ranks, plan), POLL_S, "controller-agents")
    base = Controller(ctx, rank_scan(url, prefix, ranks, plan), POLL_S, "controller-per-rank")
    try:
        warm_up(writers, ours, stats)
        for _ in range(plan.segments):
            writers.set_mode(PER_RANK)
            if not base.started:
                base.start()
            poll_loop(base.scan, plan.settle_s, check=writers.check_alive)
            timed_segment(phase, base, plan.base_s, stats, writers, ours=False)
            writers.set_mode(AGENTS)
            poll_loop(ours.scan, plan.settle_s, check=writers.check_alive)
            timed_segment(phase, ours, ours_s, stats, writers, ours=True)
        finish(phase, ours, writers, dead_agents)
    finally:
        writers.close()
        ours.close()
        base.close()
    return phase


def phase_big(plan: Plan, ctx: mp.context.BaseContext, url: str, stats: redis.Redis,
              prefix: str) -> Phase:
    """Phase 2: node agents at `ranks_big`, against own keys written by this process."""
    ranks = plan.ranks_big
    phase, dead_agents, writers = phase_writers(plan, ctx, url, stats, prefix, ranks, 0,
                                                plan.agent_connections_big)
    static = StaticRanks(stats, f"{prefix}static:", ranks, phase.roles)
    t = time.perf_counter()
    static.write_all()
    log(f"phase 2: {ranks:,} own keys for the per-rank baseline written in "
        f"{time.perf_counter() - t:.1f}s (by this process: no per-rank writers at this scale)")
    ours_s = plan.seconds_big / plan.segments_big
    log(f"phase 2: {ranks:,} ranks on {ranks // RANKS_PER_NODE:,} nodes, node agents from "
        f"{plan.writers} writer processes on {plan.agent_connections_big:,} connections; "
        f"{plan.segments_big} x ({plan.base_s:.1f}s per-rank scans of the written keys, "
        f"{plan.settle_s:.1f}s settle + {ours_s:.1f}s node agents)")
    ours = Controller(ctx, agent_scan(url, prefix, ranks, plan), POLL_S, "controller-agents")
    base = Controller(ctx, rank_scan(url, f"{prefix}static:", ranks, plan), POLL_S,
                      "controller-per-rank")
    try:
        warm_up(writers, ours, stats)
        for _ in range(plan.segments_big):
            if not base.started:
                base.start()
            timed_segment(phase, base, plan.base_s, stats, writers, ours=False,
                          before=static.rewrite_half)
            # Every record changed while the baseline scanned: the first scan after it
            # decodes them all, where a steady poll decodes half. Untimed, as in phase 1.
            poll_loop(ours.scan, plan.settle_s, check=writers.check_alive)
            timed_segment(phase, ours, ours_s, stats, writers, ours=True)
        finish(phase, ours, writers, dead_agents)
        log(f"{phase.label}: cProfile of 3 node-agent scans (own time first; cProfile inflates "
            f"Python):\n{ours.call('profile')}")
        log(f"{phase.label}: rewriting half the baseline's keys took "
            f"{median(static.write_s[1:]) * 1e3:.0f} ms a scan (untimed, in the benchmark's process)")
    finally:
        writers.close()
        ours.close()
        base.close()
    return phase


# -- the report ----------------------------------------------------------------------

def _ms(xs: list[float], q: float) -> str:
    return f"{percentile(xs, q) * 1e3:.1f}"


def _cpu(w: Load) -> str:
    """Who used the CPUs over a window, in cores."""
    own = (w.redis_cpu_s + w.writers_cpu_s + w.controller_cpu_s) / w.wall_s
    return (f"writers {w.per_s('writers_cpu_s'):.2f}, controller {w.per_s('controller_cpu_s'):.2f}, "
            f"Redis {w.cores:.2f} cores; the machine {w.per_s('machine_cpu_s'):.2f} of "
            f"{os.cpu_count()} (others {max(0.0, w.per_s('machine_cpu_s') - own):.2f})")


def report(phase: Phase, big: bool) -> bool:
    """stderr lines for one phase; False when a design's writes fell short of their rate."""
    ranks, nodes = phase.ranks, phase.ranks // RANKS_PER_NODE
    ours_s = [t for run in phase.ours_runs for t in run]
    base_s = [t for run in phase.base_runs for t in run]
    label, parts, bparts = phase.label, phase.ours_parts, phase.base_parts
    log(f"{label}: scan p99 per segment: node agents "
        f"{', '.join(f'{x:.1f}' for x in phase.p99s(phase.ours_runs))} ms; per-rank keys "
        f"{', '.join(f'{x:.1f}' for x in phase.p99s(phase.base_runs))} ms")
    log(f"{label}: node-agent scan: {len(ours_s)} scans, p50 {_ms(ours_s, 50)} ms, p99 "
        f"{_ms(ours_s, 99)} ms, max {max(ours_s) * 1e3:.1f} ms (CPU time p50 "
        f"{_ms(phase.ours_cpu, 50)}, p99 {_ms(phase.ours_cpu, 99)} ms); p50 of its parts: read_relayed "
        f"{_ms([x[0] for x in parts], 50)}, update {_ms([x[1] for x in parts], 50)}, observe "
        f"{_ms([x[2] for x in parts], 50)} ms")
    log(f"{label}: node-agent scan breakdown (median of 6 scans, ms): "
        + ", ".join(f"{k} {v:.1f}" if k != "decoded" else f"{k} {v:.0f} records"
                    for k, v in phase.split.items()))
    log(f"{label}: per-rank scan: {len(base_s)} scans, p50 {_ms(base_s, 50)} ms, p99 "
        f"{_ms(base_s, 99)} ms (CPU time p50 {_ms(phase.base_cpu, 50)}, p99 "
        f"{_ms(phase.base_cpu, 99)} ms); p50 read_beats {_ms([x[0] for x in bparts], 50)}, observe "
        f"{_ms([x[1] for x in bparts], 50)} ms")
    log(f"{label}: GC in the node-agent controller during its segments: {phase.gc_total * 1e3:.0f} ms "
        f"in all, {len(phase.gc_gen2)} full collections, longest "
        f"{max(phase.gc_gen2, default=0) * 1e3:.0f} ms; in the per-rank one "
        f"{len(phase.base_gc_gen2)} full collections, longest "
        f"{max(phase.base_gc_gen2, default=0) * 1e3:.0f} ms")
    ok = True
    agents, rank_keys = combined(phase.ours_windows), combined(phase.base_windows)
    want_records = nodes - DEAD_AGENTS
    log(f"{label}: node agents: {agents.per_s('records'):,.0f} records/s (nominal {want_records:,}) "
        f"+ {agents.per_s('beats'):,.0f} fallback beats/s of the dead agents' ranks; Redis "
        f"{agents.per_s('commands'):,.0f} commands/s; {_cpu(agents)}")
    if agents.per_s("records") < MIN_RATE * want_records:
        log(f"LOAD NOT REACHED: {agents.per_s('records'):,.0f} records/s < {MIN_RATE:.0%} "
            f"of {want_records:,}")
        ok = False
    if big:
        log(f"{label}: per-rank segments (keys rewritten by this process, agents still writing; "
            f"not a per-rank load): {_cpu(rank_keys)}")
    else:
        want_beats = ranks - sum(x == DEAD for x in phase.roles.values())  # the dead ranks stop
        log(f"{label}: per-rank keys: {rank_keys.per_s('beats'):,.0f} beats/s (nominal "
            f"{want_beats:,}); Redis {rank_keys.per_s('commands'):,.0f} commands/s; {_cpu(rank_keys)}")
        if rank_keys.per_s("beats") < MIN_RATE * want_beats:
            log(f"LOAD NOT REACHED: {rank_keys.per_s('beats'):,.0f} beats/s < "
                f"{MIN_RATE:.0%} of {want_beats:,}")
            ok = False
    log(f"{label}: worst writer batch lateness {phase.lag * 1e3:.0f} ms, {phase.skipped} ticks "
        f"skipped; 1-min load average at the end {phase.load_avg:.1f}")
    return ok


def run(plan: Plan) -> int:
    fds = raise_fd_limit()
    # The benchmark's import-time heap would make every full collection during a scan
    # walk ~200k objects a controller does not have; freeze it (the controller
    # processes, forked from this one, inherit that) so GC pauses come from the
    # scans' own objects.
    gc.collect()
    gc.freeze()
    room = fds - 256
    if plan.connections + plan.agent_connections > room or plan.agent_connections_big > room:
        log(f"open-file limit {fds}: connections cut to {room} per phase")
        agents = min(plan.agent_connections, room // 8)
        plan = replace(plan, agent_connections=agents, connections=min(plan.connections, room - agents),
                       agent_connections_big=min(plan.agent_connections_big, room))
    ctx = mp.get_context("fork")
    prefix = f"kcbench-{random.randbytes(4).hex()}:"
    need = max(plan.connections + plan.agent_connections, plan.agent_connections_big)
    with redis_server(maxclients=need + 64) as (url, private):
        stats = redis.Redis.from_url(url)
        if not private:  # leave room for the shared server's other clients
            try:
                maxclients = int(next(iter(stats.config_get("maxclients").values()), 10000))
            except redis.ResponseError:  # CONFIG may be disabled on a shared server
                maxclients = 10000
            free = maxclients - int(stats.info("clients")["connected_clients"]) - 200
            if need > free:
                log(f"shared Redis has room for {free} connections; using that many")
                agents = max(plan.writers, min(plan.agent_connections, free // 8))
                plan = replace(plan, agent_connections=agents,
                               connections=max(plan.writers, free - agents),
                               agent_connections_big=max(plan.writers, free))
        try:
            wait_for_quiet(timeout_s=10)
            with measure(stats, None) as idle:
                time.sleep(plan.idle_s)
            log(f"Redis idle: {idle[0].cores:.4f} cores; the machine {idle[0].per_s('machine_cpu_s'):.2f} "
                f"of {os.cpu_count()} CPUs busy")
            small = phase_mixed(plan, ctx, url, stats, prefix)
            ok = report(small, big=False) and small.ok
            emit_small(small)
            big = phase_big(plan, ctx, url, stats, f"{prefix}big:")
            ok = report(big, big=True) and big.ok and ok
            emit_big(big)
        finally:
            if not private:
                delete_keys(url, prefix)
    return 0 if ok else 1


def emit_scan(phase: Phase, metric: str, target: float, settings: str) -> None:
    """A scan line: the median over segments of each segment's p99, ours against the baseline."""
    ours, base = phase.p99s(phase.ours_runs), phase.p99s(phase.base_runs)
    emit(BENCH, metric, "ms", median(ours), median(base), target, better="lower",
         target_on="ours", spread={"ours": ours, "baseline": base},
         settings=f"{phase.ranks} ranks, {RANKS_PER_NODE} a node; {settings}")


def emit_small(phase: Phase) -> None:
    ranks, nodes = phase.ranks, phase.ranks // RANKS_PER_NODE
    emit_scan(phase, "heartbeat_scan_ms_p99", 100,
              f"ours: node agents ({nodes} records: read_relayed + RelayView.update + "
              f"BeatTable.observe); baseline: per-rank keys (read_beats over {ranks} own keys + "
              "Classifier.observe), alternating with ours on the same writer processes")
    cores = [w.cores for w in phase.ours_windows]
    bcores = [w.cores for w in phase.base_windows]
    emit(BENCH, "redis_cpu_fraction", "cores", median(cores), median(bcores), 0.5, better="lower",
         target_on="ours", spread={"ours": cores, "baseline": bcores},
         settings=f"{ranks} ranks; ours: {nodes} node agents, one round trip a second each (SET "
                  "of the record, SMEMBERS, one MGET of the flags and each relayed rank's stack "
                  f"request), and the node-agent scan; baseline: {ranks} ranks each beating its own "
                  "key a second (SISMEMBER, SET, GET, EXISTS), and the per-rank scan; Redis CPU "
                  "over wall time")


def emit_big(phase: Phase) -> None:
    ranks, nodes = phase.ranks, phase.ranks // RANKS_PER_NODE
    emit_scan(phase, "heartbeat_scan_ms_p99_131k", 250,
              f"ours: node agents ({nodes} records written a second by the writer processes); "
              f"baseline: read_beats over {ranks} own keys written by the bench itself (no "
              "per-rank writers at this scale), half rewritten before each scan, alternating "
              "with ours")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=25.0,
                        help="seconds of node-agent scans at --ranks, over 4 segments")
    parser.add_argument("--seconds-big", type=float, default=15.0,
                        help="seconds of node-agent scans at --ranks-big, over 3 segments")
    parser.add_argument("--ranks", type=int, default=16_384)
    parser.add_argument("--ranks-big", type=int, default=131_072)
    parser.add_argument("--writers", type=int, default=4, help="writer processes")
    parser.add_argument("--connections", type=int, default=None,
                        help="Redis connections for the per-rank keys, over all writers "
                             "(default: one per rank)")
    parser.add_argument("--agent-connections", type=int, default=None,
                        help="Redis connections for the node agents, over all writers "
                             "(default: one per agent)")
    parser.add_argument("--quick", action="store_true",
                        help="1,024 and 8,192 ranks, 2 writers, heartbeat timeout 6 s, the "
                             "shortest segments: checks the script works (about 35-40 s)")
    args = parser.parse_args()
    extra: dict = {}
    if args.quick:
        args.ranks, args.ranks_big, args.writers = 1024, 8192, 2
        args.seconds, args.seconds_big = 6.0, 6.0
        extra = {"segments": 2, "segments_big": 2, "base_s": 2.0, "settle_s": 0.5,
                 "timeout_s": 6.0, "hang_s": 3.0, "idle_s": 1.0}
    if args.ranks < 64 or args.ranks % RANKS_PER_NODE or args.ranks_big % RANKS_PER_NODE \
            or args.ranks_big < 64 or args.writers < 1:
        parser.error(f"need --ranks and --ranks-big >= 64, multiples of {RANKS_PER_NODE}, "
                     "and --writers >= 1")
    plan = Plan(args.ranks, args.ranks_big, args.writers, args.connections or args.ranks,
                args.agent_connections or args.ranks // RANKS_PER_NODE,
                args.agent_connections or args.ranks_big // RANKS_PER_NODE,
                args.seconds, args.seconds_big, **extra)
    need = DEAD_AFTER_S + plan.timeout_s + 2.5  # dead ranks and agents expire, then a scan sees it
    for big in (False, True):
        if plan.phase_s(big) < need:
            parser.error(f"the {'second' if big else 'first'} phase lasts {plan.phase_s(big):.0f}s: "
                         f"raise --seconds{'-big' if big else ''} so it lasts {need:.0f}s")
    # Each design's classifier must see its keys again within the timeout after the other's segment.
    if plan.settle_s + plan.seconds / plan.segments + 1.5 > plan.timeout_s:
        parser.error(f"--seconds / {plan.segments} must stay under "
                     f"{plan.timeout_s - plan.settle_s - 1.5:.1f}s")
    sys.exit(run(plan))


if __name__ == "__main__":
    main()
