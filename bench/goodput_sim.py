"""Goodput at scale, by simulation: projected ETTR of a long training run under failures.

ETTR (effective training time ratio) is the share of wall-clock time spent on training steps
that are kept. This projects it, with the time lost by cause (start-up, checkpoint stalls,
detection, restart, redone steps), on 1,024 to 16,384 GPUs under three settings:

* `disk_only`: periodic asynchronous checkpoints to shared storage; any interruption restarts
  the whole job, which restores the newest committed checkpoint and redoes the steps since.
* `peer_memory`: also, every step each rank's state is copied to `peer_replicas` peers' host
  memory. The whole job still restarts, restoring from the peers' copies: the step in flight
  is redone (one more if its copy had not landed). The copies are assumed to be held outside
  the training processes (a node-local store), so they outlive a restart of every rank.
* `survivors_keep_work`: peer memory, and a failure confined to one data-parallel replica
  replaces that replica while the others keep their state. The job waits for detection and a
  short regroup (`survivor_stall_s`), the step in flight is redone, and only the replacement
  replica restarts (its `replica_gpus / gpus` share of the job idles meanwhile). Failures that
  can take out more than one replica (`job_wide_fraction`, `hang_fraction`) fall back to a
  full restart from peer memory. A healthy node for the replacement is assumed to be there (no
  spare pool is modelled), as it is for the other settings' full restarts.

Why Monte Carlo, not a closed form (Young/Daly; Kokolis et al.'s ETTR estimate): a failure
during a restart starts it over, an asynchronous save still writing when a failure comes is not
there to restore, a peer copy in flight costs a step. Replaying seeded arrivals over the run's
wall clock keeps those cases; the three settings replay the same arrivals, so their comparison
is not noise; with no failures it reduces exactly to the overheads. A projection is the mean of
`--runs` seeded runs (`random.Random`) of `--days` days.

Failure rates. Llama 3 (Dubey et al., "The Llama 3 Herd of Models", 2024, section 3.3.4 and
Table 5): 466 job interruptions in a 54-day snapshot of pre-training on 16,384 H100 GPUs, 47
planned and 419 unexpected (about 78% of those attributed to hardware); effective training
time "higher than 90%". From Table 5, 7 NCCL watchdog timeouts are hangs (`hang_fraction`);
54 software bugs, 2 dependency failures and 35 network switch/cable failures may take out more
than one replica (`job_wide_fraction`; conservative for cables); the rest stay on one node.
The unexpected rate is linear in the GPUs (the series model, as Kokolis et al., "Revisiting
Reliability in Large-Scale Machine Learning Research Clusters", 2024, fit MTTF to GPU count);
planned stops are per job. A planned stop saves the state, then restarts the whole job.

Costs (measured here: bench/README.md, bench/results/latest.jsonl; scaled as follows):

* Start-up/restart of the whole job: `measured + restart_s_per_doubling * log2(gpus /
  measured_world) + restore`, `measured` being `first_step_s` (overhead.py) for the first
  start and `mttr_s - crash_detect_s` (recovery.py; detection is counted apart) for a restart,
  both at 2 ranks. With one world size measured, the growth comes from a published restart at
  scale: fully synchronous training stalls 10 minutes a failure at O(100K) GPUs (Salpekar et
  al., "Training LLMs with Fault Tolerant HSDP on 100,000 GPUs", 2026, abstract). The line
  through the measured point and 600 s at 100,000 GPUs: 38.0 s a doubling, ~500 s at 16,384,
  ~235 s for one 128-GPU replica (the paper gets 3 minutes with replica-level recovery).
* Restore: `bytes_per_gpu` over the storage bandwidth per GPU (disk) or the link (peers).
* Storage bandwidth per GPU: `min(storage_rank_Bps, storage_total_Bps / gpus)`.
* A save holds the step for `max(blocked_fraction * write, write - interval)`: the measured
  blocked share of an asynchronous save, or the wait for a write that outlasts the interval.
  A peer copy per step likewise, with the link and one step.
* Detection: `heartbeat_timeout_s` plus one heartbeat scan of all ranks (measured at 16,384,
  linear in ranks); `hang_timeout_s` for a hang. No failure is assumed to be seen sooner by
  its process exiting (kc sees a crash in ~0.1 s), so this is an upper bound.
* Weak scaling: every GPU holds `bytes_per_gpu` and a step takes `step_s` at every size.

Calibration: Llama 3's interruption rate, disk only, Llama-3-like costs (`llama3_like`) lands
within 5 points of 0.90. Each input's value and source is on `Inputs`.

Run: .venv/bin/python bench/goodput_sim.py [--gpus 16384] [--days 54] [--seed 0] [--runs 20]
     [--inputs bench/results/latest.jsonl] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

SETTINGS = ("disk_only", "peer_memory", "survivors_keep_work")
SIZES = (1_024, 2_048, 4_096, 8_192, 16_384)
CAUSES = ("startup", "checkpoint", "detection", "restart", "redone")
DAY_S = 86_400.0

# Llama 3, section 3.3.4 and Table 5 (see the module docstring).
LLAMA3_GPUS, LLAMA3_DAYS = 16_384, 54
LLAMA3_UNEXPECTED, LLAMA3_PLANNED = 419, 47
LLAMA3_HANGS = 7  # "NCCL watchdog timeouts"
LLAMA3_JOB_WIDE = 54 + 2 + 35  # software bug, dependency, network switch/cable
LLAMA3_ETTR = 0.90  # "higher than 90%": the reference the calibration is held to
CALIBRATION_TOLERANCE = 0.05

# Salpekar et al. 2026 (FT-HSDP), abstract: synchronous training stalls 10 min per failure at
# O(100K) GPUs. The anchor for restart growth with world size, and Llama-3-like restart cost.
FT_HSDP_STALL_S, FT_HSDP_GPUS = 600.0, 100_000
MEASURED_MTTR_S, MEASURED_WORLD = 6.608, 2  # recovery.py mttr_s, latest.jsonl (2026-12-03)
RESTART_S_PER_DOUBLING = round(
    (FT_HSDP_STALL_S - MEASURED_MTTR_S) / math.log2(FT_HSDP_GPUS / MEASURED_WORLD), 1)


@dataclass(frozen=True)
class Inputs:
    """Every input of the model. Defaults: kc's measured costs and Llama 3's failure rates."""

    # Failures (Llama 3, section 3.3.4, Table 5).
    failures_per_gpu_day: float = LLAMA3_UNEXPECTED / (LLAMA3_DAYS * LLAMA3_GPUS)
    planned_per_day: float = LLAMA3_PLANNED / LLAMA3_DAYS  # per job, not scaled with GPUs
    hang_fraction: float = LLAMA3_HANGS / LLAMA3_UNEXPECTED
    job_wide_fraction: float = LLAMA3_JOB_WIDE / LLAMA3_UNEXPECTED
    # Workload, Llama-3-405B-like. 14 bytes a parameter (bf16 weights, fp32 master weights and
    # two Adam moments) spread over 16,384 GPUs: within Llama 3's "1 MB to 4 GB per GPU".
    bytes_per_gpu: float = 405e9 * 14 / LLAMA3_GPUS
    # 6 FLOPs x 405e9 parameters x 16M tokens a step at ~40% of 989 TFLOP/s on 16,384 GPUs
    # (Llama 3's batch and MFU of 38-43%, Table 4, as recalled, not checked here).
    step_s: float = 6.0
    ckpt_interval_steps: int = 50  # kc's checkpoint.interval_steps default
    replica_gpus: int = 128  # one data-parallel replica: Llama 3's TP 8 x PP 16 (as recalled)
    peer_replicas: int = 1  # peers holding each rank's copy (checkpoint.in_memory.replicas)
    # Storage and network.
    storage_rank_Bps: float = 167e6  # ckpt_io.py s3_ckpt_throughput, measured 2026-12-04
    storage_total_Bps: float = 2e12  # Llama 3 section 3.3.1: Tectonic, 2 TB/s sustained
    link_Bps: float = 50e9  # Llama 3 section 3.3.1: 400 Gbps per GPU
    blocked_fraction: float = 0.020  # ckpt_io.py s3_async_blocked_fraction, measured
    # Detection: the docs' fast settings (docs/fault-tolerance.md, examples/fault-drill.yaml).
    heartbeat_timeout_s: float = 5.0
    hang_timeout_s: float = 60.0
    scan_s_16k: float = 0.0566  # heartbeats.py heartbeat_scan_ms_p99 at 16,384 ranks, 2026-12-05
    # Start-up and recovery, measured at measured_world ranks (latest.jsonl, 2026-12-03).
    first_step_s: float = 6.638  # overhead.py time_to_first_step_ratio (ours)
    mttr_s: float = MEASURED_MTTR_S  # recovery.py mttr_s: SIGKILL -> first step, in place
    crash_detect_s: float = 0.117  # recovery.py crash_detect_ms p99: inside mttr_s
    survivor_stall_s: float = 0.436  # goodput.py survivor_stall_s (median of 10 kills), 2026-12-06
    measured_world: int = MEASURED_WORLD
    restart_s_per_doubling: float = RESTART_S_PER_DOUBLING  # anchored to FT-HSDP's 10 min

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int | float) or isinstance(value, bool) \
                    or not math.isfinite(value):
                raise ValueError(f"{f.name} must be a finite number, got {value!r}")
            if value < 0:
                raise ValueError(f"{f.name} must be >= 0, got {value}")
        for name in ("storage_rank_Bps", "storage_total_Bps", "link_Bps", "step_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}: "
                                 "no checkpoint or step could ever finish")
        for name in ("ckpt_interval_steps", "replica_gpus", "peer_replicas", "measured_world"):
            if getattr(self, name) < 1 or int(getattr(self, name)) != getattr(self, name):
                raise ValueError(f"{name} must be a whole number >= 1, got {getattr(self, name)}")
        for name in ("hang_fraction", "job_wide_fraction", "blocked_fraction"):
            if getattr(self, name) > 1:
                raise ValueError(f"{name} is a share and must be <= 1, got {getattr(self, name)}")
        if self.hang_fraction + self.job_wide_fraction > 1:
            raise ValueError("hang_fraction + job_wide_fraction must be <= 1, got "
                             f"{self.hang_fraction + self.job_wide_fraction:.3f}")


def llama3_like(base: Inputs | None = None) -> Inputs:
    """Llama-3-like costs for the calibration (not published for Llama 3; each named here).

    A restart of 10 minutes, detection included (FT-HSDP's synchronous stall per failure), no
    growth with world size (only 16,384 GPUs are simulated), synchronous checkpoints (the paper
    describes bursty writes saturating the storage fabric, not asynchronous saves) every 150
    steps, i.e. 15 minutes at 6 s a step.
    """
    return replace(base or Inputs(), first_step_s=FT_HSDP_STALL_S, mttr_s=FT_HSDP_STALL_S,
                   crash_detect_s=0.0, restart_s_per_doubling=0.0, heartbeat_timeout_s=0.0,
                   hang_timeout_s=0.0, scan_s_16k=0.0, blocked_fraction=1.0,
                   ckpt_interval_steps=150)


# -- Costs at a size ------------------------------------------------------------------------


@dataclass(frozen=True)
class Costs:
    """What each event costs, in seconds, for one setting at one size (derived from Inputs)."""

    step_s: float
    peer_stall: float  # the wait for a step's peer copy (0 for disk_only)
    steps_per_ckpt: int
    ckpt_stall: float
    write_s: float  # a disk save's write, from its stall to its commit
    peer_copy_s: float  # a step's copy to its peers, from the step's end to landing
    startup: float
    restart: float  # the whole job, restoring from this setting's source
    detect: float
    detect_hang: float
    replica_stall: float  # survivors_keep_work: regroup + the replacement's share of the job

    @property
    def step_wall(self) -> float:
        return self.step_s + self.peer_stall

    @property
    def train_wall(self) -> float:
        return self.steps_per_ckpt * self.step_wall

    @property
    def cycle(self) -> float:
        return self.train_wall + self.ckpt_stall


def per_doubling(mttr_s: float, measured_world: int) -> float:
    """Restart growth per doubling of the world: the line from the measured restart to
    FT-HSDP's published stall at O(100K) GPUs."""
    return (FT_HSDP_STALL_S - mttr_s) / math.log2(FT_HSDP_GPUS / measured_world)


def growth_s(inp: Inputs, world: int) -> float:
    """Start-up growth past the measured world size: a fixed cost per doubling."""
    return inp.restart_s_per_doubling * math.log2(max(world, inp.measured_world)
                                                  / inp.measured_world)


def storage_Bps(inp: Inputs, gpus: int) -> float:
    """Each rank writes its shard at the measured per-writer rate until the store's aggregate
    bandwidth, shared by every rank, is the tighter bound."""
    return min(inp.storage_rank_Bps, inp.storage_total_Bps / gpus)


def background_stall(inp: Inputs, transfer_s: float, between_s: float) -> float:
    """The step waits for the blocked share of a background transfer, and for the part of a
    transfer that outlasts the time until the next one begins."""
    return max(inp.blocked_fraction * transfer_s, transfer_s - between_s)


def costs(inp: Inputs, gpus: int, setting: str) -> Costs:
    peer = setting != "disk_only"
    peer_copy = inp.bytes_per_gpu * inp.peer_replicas / inp.link_Bps if peer else 0.0
    peer_stall = background_stall(inp, peer_copy, inp.step_s) if peer else 0.0
    write = inp.bytes_per_gpu / storage_Bps(inp, gpus)
    interval = inp.ckpt_interval_steps * (inp.step_s + peer_stall)
    restore = inp.bytes_per_gpu / (inp.link_Bps if peer else storage_Bps(inp, gpus))
    scan = inp.scan_s_16k * gpus / LLAMA3_GPUS  # one MGET per rank key: linear in ranks
    restart = max(0.0, inp.mttr_s - inp.crash_detect_s)
    # The replacement replica starts at its own size and copies the state from a live replica.
    replica = restart + growth_s(inp, inp.replica_gpus) + inp.bytes_per_gpu / inp.link_Bps
    return Costs(
        step_s=inp.step_s, peer_stall=peer_stall, steps_per_ckpt=int(inp.ckpt_interval_steps),
        ckpt_stall=background_stall(inp, write, interval), write_s=write, peer_copy_s=peer_copy,
        startup=inp.first_step_s + growth_s(inp, gpus),
        restart=restart + growth_s(inp, gpus) + restore,
        detect=inp.heartbeat_timeout_s + scan, detect_hang=inp.hang_timeout_s + scan,
        replica_stall=inp.survivor_stall_s + replica * min(1.0, inp.replica_gpus / gpus))


# -- Interruptions ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    t: float
    kind: str  # "planned", "hang", "job_wide", "local", or "end" (of the run)


def draw_events(inp: Inputs, gpus: int, wall: float, rng: random.Random) -> list[Event]:
    """One run's interruptions in wall-clock time: Poisson arrivals, the unexpected ones at a
    rate linear in the GPUs, each given its kind by Table 5's shares."""
    unexpected = inp.failures_per_gpu_day * gpus / DAY_S
    rate = unexpected + inp.planned_per_day / DAY_S
    events: list[Event] = []
    t = 0.0
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= wall:
            break
        events.append(Event(t, _kind(inp, rng, unexpected / rate)))
    return events


def _kind(inp: Inputs, rng: random.Random, unexpected_share: float) -> str:
    if rng.random() >= unexpected_share:
        return "planned"
    u = rng.random()
    if u < inp.hang_fraction:
        return "hang"
    return "job_wide" if u < inp.hang_fraction + inp.job_wide_fraction else "local"


# -- One run ---------------------------------------------------------------------------------


def up_period(c: Costs, e: float, setting: str, ending: str) -> dict[str, float]:
    """Split `e` seconds of running into productive time, checkpoint stalls and redone work.

    The period starts from a restored (or fresh) state and runs cycles of `steps_per_ckpt`
    steps (each followed by its peer-copy stall) and one checkpoint stall; `ending` is the
    event that ended it: "end" of the run keeps all work, otherwise what is kept depends on
    the setting (`_kept_steps`).
    """
    k, r = divmod(e, c.cycle)
    if r >= c.train_wall:  # in the checkpoint stall: every step of the cycle is done
        whole, into_step, since_step = c.steps_per_ckpt, 0.0, r - c.train_wall
    else:
        whole = min(math.floor(r / c.step_wall), c.steps_per_ckpt - 1)
        into_step = since_step = r - whole * c.step_wall
    steps = int(k) * c.steps_per_ckpt + whole
    computed = steps * c.step_s + min(into_step, c.step_s)
    productive = computed if ending == "end" else \
        _kept_steps(c, e, steps, since_step, setting, ending) * c.step_s
    return {"productive": productive, "checkpoint": e - computed, "redone": computed - productive}


def _kept_steps(c: Costs, e: float, steps: int, since_step: float, setting: str,
                ending: str) -> int:
    if ending == "planned":
        return steps  # a planned stop saves the state on the way down
    if setting == "disk_only":
        return _committed_steps(c, e)
    if setting == "survivors_keep_work" and ending == "local":
        return steps  # survivors hold their state; only the step in flight is lost
    landed = since_step >= c.peer_copy_s  # else the last step's copy was still on its way
    return steps if landed or steps == 0 else steps - 1


def _committed_steps(c: Costs, e: float) -> int:
    """Steps covered by the newest disk checkpoint committed by `e`: save j begins its write at
    j * cycle + train_wall and commits write_s later."""
    j = math.floor((e - c.train_wall - c.write_s) / c.cycle)
    return (j + 1) * c.steps_per_ckpt if j >= 0 else 0


def _recovery(c: Costs, setting: str, kind: str, full: bool) -> tuple[list[list], bool]:
    """The downtime an interruption starts, as [cause, seconds] segments, and whether it is a
    full restart. A failure during a full restart starts that restart over. After a survivors'
    regroup the checkpoint cycle starts afresh (a simplification: saves shift by the stall)."""
    if kind == "planned":  # the state is saved on the way down, then the job restarts
        saved = c.write_s if setting == "disk_only" else c.peer_copy_s
        return [["checkpoint", saved], ["restart", c.restart]], True
    if kind == "local" and setting == "survivors_keep_work" and not full:
        return [["detection", c.detect], ["restart", c.replica_stall]], False
    detect = c.detect_hang if kind == "hang" else c.detect
    return [["detection", detect], ["restart", c.restart]], True


def _serve(acct: dict[str, float], down: list[list], t: float, until: float) -> float:
    """Spend downtime segments from `t` until they are done or `until` comes; the segments
    left (the first one shortened) stay in `down`. Returns the time reached."""
    while down and t < until:
        cause, left = down[0]
        spent = min(left, until - t)
        acct[cause] += spent
        t += spent
        if spent < left:
            down[0][1] = left - spent
        else:
            down.pop(0)
    return t


def simulate_run(c: Costs, setting: str, events: Iterable[Event], wall: float
                 ) -> dict[str, float]:
    """Replay one run's interruptions; returns seconds by cause, plus "productive"."""
    acct = dict.fromkeys(("productive", *CAUSES), 0.0)
    down: list[list] = [["startup", c.startup]]
    full, t, up_since = True, 0.0, 0.0
    for ev in [*events, Event(wall, "end")]:
        if down:
            t = _serve(acct, down, t, ev.t)
            if down:  # the interruption came during downtime
                if ev.kind not in ("planned", "end"):  # a planned stop waits for the job to run
                    down, full = _recovery(c, setting, ev.kind, full)
                continue
            up_since = t
        for cause, seconds in up_period(c, ev.t - up_since, setting, ev.kind).items():
            acct[cause] += seconds
        t = ev.t
        if ev.kind != "end":
            down, full = _recovery(c, setting, ev.kind, False)
    return acct


# -- Projections -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Projection:
    """Means over the runs, in hours of the job's wall clock."""

    setting: str
    gpus: int
    ettr: float
    productive_h: float
    lost_h: dict[str, float]
    wall_h: float
    interruptions: float


def project(inp: Inputs, gpus: int, days: float, runs: int = 20, seed: int = 0
            ) -> dict[str, Projection]:
    """Project every setting at `gpus` GPUs over `days` days, from `runs` seeded runs whose
    interruption arrivals are shared by the settings."""
    _check_run(inp, gpus, days, runs)
    wall = days * DAY_S
    totals = {s: dict.fromkeys(("productive", *CAUSES), 0.0) for s in SETTINGS}
    count = 0
    for run in range(runs):
        events = draw_events(inp, gpus, wall, random.Random(f"goodput:{seed}:{gpus}:{run}"))
        count += len(events)
        for setting in SETTINGS:
            acct = simulate_run(costs(inp, gpus, setting), setting, events, wall)
            for cause, seconds in acct.items():
                totals[setting][cause] += seconds
    return {s: _projection(s, gpus, totals[s], runs, wall, count / runs) for s in SETTINGS}


def _projection(setting: str, gpus: int, total: dict[str, float], runs: int, wall: float,
                interruptions: float) -> Projection:
    hours = {cause: seconds / runs / 3600 for cause, seconds in total.items()}
    return Projection(setting, gpus, total["productive"] / (runs * wall), hours["productive"],
                      {cause: hours[cause] for cause in CAUSES}, wall / 3600, interruptions)


def _check_run(inp: Inputs, gpus: int, days: float, runs: int) -> None:
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be a whole number >= 1, got {gpus!r}")
    if gpus < inp.replica_gpus:
        raise ValueError(f"gpus ({gpus}) is smaller than one data-parallel replica "
                         f"(replica_gpus {inp.replica_gpus})")
    if not days > 0 or not math.isfinite(days):
        raise ValueError(f"days must be > 0, got {days}")
    if not isinstance(runs, int) or runs < 1:
        raise ValueError(f"runs must be a whole number >= 1, got {runs!r}")


def calibrate(base: Inputs | None = None, runs: int = 20, seed: int = 0) -> dict:
    """Llama 3's interruptions (466 in 54 days on 16,384 GPUs), disk only, Llama-3-like costs;
    with the checkpoint interval at 10, 15 (the chosen value) and 30 minutes."""
    inp = llama3_like(base)
    by_interval: dict[int, float] = {}
    for steps in (100, 150, 300):
        alt = replace(inp, ckpt_interval_steps=steps)
        got = project(alt, LLAMA3_GPUS, LLAMA3_DAYS, runs, seed)["disk_only"].ettr
        by_interval[round(steps * alt.step_s / 60)] = got
    ettr = by_interval[round(inp.ckpt_interval_steps * inp.step_s / 60)]
    return {"reference": LLAMA3_ETTR, "tolerance": CALIBRATION_TOLERANCE, "ettr": ettr,
            "within": abs(ettr - LLAMA3_ETTR) <= CALIBRATION_TOLERANCE,
            "by_interval_min": by_interval}


# -- Measured inputs from a bench results file -----------------------------------------------

MEASURED = {  # (bench, metric) -> (Inputs field, factor to its unit); "ours" is the value
    ("overhead", "time_to_first_step_ratio"): ("first_step_s", 1.0),
    # bench/goodput.py's survivor stall is the measured value itself; in a results file
    # without it, recovery.py's warm-spare MTTR stands in for it.
    ("goodput", "survivor_stall_s"): ("survivor_stall_s", 1.0),
    ("recovery", "mttr_s"): ("mttr_s", 1.0),
    ("recovery", "crash_detect_ms"): ("crash_detect_s", 1e-3),
    ("recovery", "mttr_s_warm_spares"): ("survivor_stall_s", 1.0),
    ("ckpt_io", "s3_ckpt_throughput"): ("storage_rank_Bps", 1.0),
    ("ckpt_io", "s3_async_blocked_fraction"): ("blocked_fraction", 1.0),
    ("heartbeats", "heartbeat_scan_ms_p99"): ("scan_s_16k", 1e-3),  # its default 16,384 ranks
}


def load_inputs(path: str | Path, base: Inputs | None = None) -> tuple[Inputs, list[str]]:
    """Replace the measured inputs found in a bench results file (JSON lines with "bench",
    "metric" and "ours"); returns the inputs and the fields replaced. The restart growth is
    re-anchored when mttr_s is replaced."""
    base = base or Inputs()
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"cannot read --inputs {path}: {e.strerror}") from None
    found: dict[str, Any] = {}  # field -> value, each of the field's own type
    direct: set[str] = set()  # fields set by goodput's own survivor_stall_s line
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            raise ValueError(f"{path} line {n} is not JSON") from None
        target = MEASURED.get((line.get("bench"), line.get("metric")))
        if target and isinstance(line.get("ours"), int | float) and target[0] not in direct:
            found[target[0]] = line["ours"] * target[1]
            if line["bench"] == "goodput":
                direct.add(target[0])
    if "mttr_s" in found:
        found["restart_s_per_doubling"] = round(per_doubling(found["mttr_s"],
                                                             base.measured_world), 1)
    return replace(base, **found), sorted(found)


# -- Output ----------------------------------------------------------------------------------


def report(inp: Inputs, gpus: int, days: float, runs: int, seed: int) -> dict:
    detail = project(inp, gpus, days, runs, seed)
    by_gpus: dict[str, dict[int, float]] = {s: {} for s in SETTINGS}
    for n in SIZES:
        at = detail if n == gpus else project(inp, n, days, runs, seed)
        for s in SETTINGS:
            by_gpus[s][n] = at[s].ettr
    return {"gpus": gpus, "days": days, "runs": runs, "seed": seed, "inputs": asdict(inp),
            "detail": {s: asdict(p) for s, p in detail.items()}, "ettr_by_gpus": by_gpus,
            "calibration": calibrate(inp, runs, seed)}


def render(rep: dict) -> str:
    inp, gpus = Inputs(**rep["inputs"]), rep["gpus"]
    per_day = inp.failures_per_gpu_day * gpus
    lines = [f"goodput_sim: {gpus:,} GPUs, {rep['days']:g} days, mean of {rep['runs']} seeded "
             f"runs (seed {rep['seed']}); {per_day:.2f} unexpected interruptions a day "
             f"(Llama 3's rate, linear in GPUs) + {inp.planned_per_day:.2f} planned",
             "", f"| setting | ETTR | {' | '.join(c + ' h' for c in CAUSES)} | productive h "
             "| interruptions |", "|---|---" + "|---" * len(CAUSES) + "|---|---|"]
    for s, p in rep["detail"].items():
        lost = " | ".join(f"{p['lost_h'][c]:.1f}" for c in CAUSES)
        lines.append(f"| {s} | {p['ettr']:.3f} | {lost} | {p['productive_h']:.1f} "
                     f"| {p['interruptions']:.1f} |")
    lines += ["", "| ETTR by GPUs | " + " | ".join(f"{n:,}" for n in SIZES) + " |",
              "|---" + "|---" * len(SIZES) + "|"]
    for s, row in rep["ettr_by_gpus"].items():
        lines.append(f"| {s} | " + " | ".join(f"{row[n]:.3f}" for n in SIZES) + " |")
    cal = rep["calibration"]
    alts = ", ".join(f"{m} min {e:.3f}" for m, e in cal["by_interval_min"].items())
    lines += ["", f"calibration: Llama 3's 466 interruptions in 54 days on 16,384 GPUs, disk "
              f"only, Llama-3-like costs: ETTR {cal['ettr']:.3f} against {cal['reference']:.2f} "
              f"reported ({'within' if cal['within'] else 'NOT within'} "
              f"{cal['tolerance'] * 100:.0f} points); checkpoint every {alts}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=16_384, help="size of the by-cause table")
    ap.add_argument("--days", type=float, default=LLAMA3_DAYS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=20, help="seeded runs averaged per projection")
    ap.add_argument("--inputs", help="bench results JSON lines to take measured inputs from")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    args = ap.parse_args(argv)
    try:
        inp, applied = load_inputs(args.inputs) if args.inputs else (Inputs(), [])
        rep = report(inp, args.gpus, args.days, args.runs, args.seed)
    except ValueError as e:
        print(f"goodput_sim: {e}", file=sys.stderr)
        return 2
    if args.inputs:
        print(f"goodput_sim: from {args.inputs}: {', '.join(applied) or 'nothing'}",
              file=sys.stderr)
    print(json.dumps(rep) if args.json else render(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
