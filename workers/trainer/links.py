"""The link probe: which node's network holds the job back (a straggler).

A node whose link slows down does not fail: every data-parallel all-reduce
simply waits for it, and the whole job's communication share rises. The train
loop watches each step's communication seconds (`CommTrigger`, pure); when the
recent median rises well above the level the job started this generation at,
every rank agrees (one all-reduce, checked every `CHECK_EVERY` steps) to run
`probe`: the lowest rank of each node, one node at a time so that no two share
a link while measured, times a write of `PROBE_BYTES` random bytes to the
control plane's Redis. When a node seems slow, every node is measured once more
and keeps its better rate (one write that met a busy CPU is not a slow link). A
node still under half the best node's rate is
slow (`slow_nodes`, pure): rank 0 records a `straggler` event naming it, and
every rank keeps the result for `kc debug comm` (`WorkerTelemetry.links`).

The probe touches no checkpoint, data position or RNG state (its bytes come from
`os.urandom`), so training goes on exactly as it would have. A write still going
after `WRITE_TIMEOUT_S` is given up and counts at the rate it reached (the slowest
link must not escape the verdict by being too slow to measure); one Redis refuses
leaves that node's rate out.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from kuangchao.platform.jobs.link_probe import timed_write
from kuangchao.platform.observability import metrics as m
from kuangchao.workers.collectives import permit
from kuangchao.workers.runtime.context import TrainContext

PROBE_BYTES = 8 << 20
SLOW_RATIO = 0.5  # a node under half the best node's rate is slow
CHECK_EVERY = 10  # steps between checks of the trigger (each check is one small all-reduce)
BASELINE_STEPS = 10  # the level: median communication seconds of the first steps trained
RECENT_STEPS = 5  # the current level: median of the last steps
RISE = 3.0  # probe when the current level is over RISE x the baseline ...
FLOOR_S = 0.05  # ... and over this (a rise from microseconds is noise, not a link)
MIN_GAP_S = 60.0  # at most one probe per minute
WRITE_TIMEOUT_S = 30.0  # at most; a third of the job's hang timeout when that is less


def slow_nodes(rates: Mapping[str, float | None], ratio: float = SLOW_RATIO) -> list[str]:
    """Nodes measured at under `ratio` x the best node's rate, sorted; a node without a
    rate (its probe failed) is not judged, and fewer than two rates judge nothing."""
    measured = {n: r for n, r in rates.items() if r is not None and r > 0}
    if len(measured) < 2:
        return []
    best = max(measured.values())
    return sorted(n for n, r in measured.items() if r < ratio * best)


class CommTrigger:
    """When a link probe is due, from each step's communication seconds and share.

    The baseline is the median over the first `baseline_steps` steps observed (a
    trigger is made at each (re)start of training, so it is this generation's level);
    the probe is due when the median of the last `recent_steps` exceeds `rise` x the
    baseline and `floor_s`, and no probe ran in the last `min_gap_s` seconds.
    """

    def __init__(self, baseline_steps: int = BASELINE_STEPS, recent_steps: int = RECENT_STEPS,
                 rise: float = RISE, floor_s: float = FLOOR_S, min_gap_s: float = MIN_GAP_S,
                 last_probe: float | None = None) -> None:
        self.baseline_steps, self.rise, self.floor_s = baseline_steps, rise, floor_s
        self.min_gap_s, self.last_probe = min_gap_s, last_probe
        self._first: list[tuple[float, float]] = []
        self._recent: deque[tuple[float, float]] = deque(maxlen=recent_steps)
        self.baseline: float | None = None
        self.baseline_share: float | None = None

    def observe(self, comm_s: float, share: float = 0.0) -> None:
        if self.baseline is None:
            self._first.append((comm_s, share))
            if len(self._first) >= self.baseline_steps:
                self.baseline = statistics.median(c for c, _ in self._first)
                self.baseline_share = statistics.median(s for _, s in self._first)
                self._first = []
            return
        self._recent.append((comm_s, share))

    def current(self) -> tuple[float, float] | None:
        """The median communication seconds and share of the last steps, once there are enough."""
        if self.baseline is None or len(self._recent) < (self._recent.maxlen or 0):
            return None
        return (statistics.median(c for c, _ in self._recent),
                statistics.median(s for _, s in self._recent))

    def due(self, now: float) -> bool:
        level = self.current()
        if level is None or self.baseline is None:
            return False
        if self.last_probe is not None and now - self.last_probe < self.min_gap_s:
            return False
        return level[0] > self.rise * self.baseline and level[0] > self.floor_s

    def probed(self, now: float) -> None:
        self.last_probe = now


class LinkWatch:
    """The train loop's side: feed the trigger each step; every `CHECK_EVERY` steps agree
    on it across ranks and probe. Made at each (re)start of the loop, so the baseline
    is the current generation's; the minute between probes carries over.

    Each generation also probes once when its baseline is in (the first check at or
    after `BASELINE_STEPS` steps): a node slow from the start raises no trigger (the
    baseline includes it), and every node's rate is known (`kc_worker_link_gbps`,
    `kc debug comm`) before anything goes wrong. That first probe is counted by steps,
    which every rank sees alike, so it needs no vote; it does not start the minute
    between probes, so a slowdown right after it is still probed promptly."""

    def __init__(self, ctx: TrainContext) -> None:
        self.ctx = ctx
        last = (ctx.telemetry.links or {}).get("at") if ctx.telemetry is not None else None
        self.trigger = CommTrigger(last_probe=last)
        self.one_node = False  # learnt from a probe: nothing to compare
        self.steps = 0  # trained in this generation
        self.first_probed = False

    def after_step(self, done: int) -> None:
        ctx, tel = self.ctx, self.ctx.telemetry
        if ctx.world_size == 1 or self.one_node:
            return
        self.steps += 1
        if tel is not None and m.WORKER_COMM_SECONDS.name in tel.values:
            self.trigger.observe(tel.values[m.WORKER_COMM_SECONDS.name],
                                 tel.values.get(m.WORKER_COMM_SHARE.name, 0.0))
        if done % CHECK_EVERY or done >= ctx.spec.training.steps:
            return
        if not self.first_probed and self.steps >= BASELINE_STEPS:
            self.first_probed = True
            self._probe()
            return
        now = time.time()
        # Every rank takes part whatever its own trigger says (one without metrics says no):
        # the check is a collective at a step every rank reaches.
        if not ctx.any_rank(self.trigger.due(now), "link probe due"):
            return
        self.trigger.probed(now)
        self._probe()

    def _probe(self) -> None:
        self.one_node = len(probe(self.ctx, self.trigger)["rates"]) < 2


def probe(ctx: TrainContext, trigger: CommTrigger | None = None) -> dict[str, Any]:
    """Measure each node's link to the control plane, one node at a time; every rank
    calls it at the same point and gets the same result:
    `{"at", "rates": {node: Gbit/s or None}, "rounds" (1, or 2 when a node seemed slow),
    "best_gbps", "slow": [node]}`."""
    nodes: list[str] = [""] * ctx.world_size
    own = ctx.node or socket.gethostname()
    if ctx.world_size > 1:
        permit("all_gather")
        with ctx.collective("all_gather (link probe: nodes)"):
            dist.all_gather_object(nodes, own)
    else:
        nodes = [own]
    leaders: dict[str, int] = {}
    for rank, node in enumerate(nodes):
        leaders.setdefault(node, rank)
    payload = os.urandom(PROBE_BYTES) if ctx.rank in leaders.values() else b""
    rates, rounds = _round(ctx, leaders, payload), 1
    if slow_nodes(rates):  # every rank sees the same rates, so all take the second round
        rounds = 2
        # A real slow link is slow every time; a write that met a busy CPU or Redis once
        # is not: each node keeps the better of two rounds before anyone is named.
        again = _round(ctx, leaders, payload)
        rates = {n: max((r for r in (rates[n], again.get(n)) if r is not None), default=None)
                 for n in rates}
    measured = [r for r in rates.values() if r is not None]
    result = {"at": time.time(), "rates": rates, "rounds": rounds,
              "best_gbps": max(measured) if measured else None, "slow": slow_nodes(rates)}
    tel = ctx.telemetry
    before = set((tel.links or {}).get("slow") or []) if tel is not None else set()
    if tel is not None:
        tel.links = result
        if leaders.get(own) == ctx.rank and rates.get(own) is not None:
            tel.values[m.WORKER_LINK_GBPS.name] = rates[own]
    if ctx.is_chief:
        _report(ctx, result, before, trigger)
    return result


def _round(ctx: TrainContext, leaders: dict[str, int], payload: bytes) -> dict[str, float | None]:
    """One measurement of every node, one node at a time (the lowest rank of each writes);
    every rank gets the same rates."""
    rates: dict[str, float | None] = {}
    for node, leader in leaders.items():  # in rank order
        mine = _measure(ctx, node, payload) if ctx.rank == leader else None
        # The turn ends for everyone at once: the others wait here while the leader writes.
        value = torch.tensor([(mine or -1.0) if ctx.rank == leader else 0.0], dtype=torch.float64)
        if ctx.world_size > 1:
            permit("all_reduce")
            with ctx.collective(f"all_reduce (link probe: {node})"):
                dist.all_reduce(value)
        got = float(value.item())
        rates[node] = got if got > 0 else None
    return rates


def _measure(ctx: TrainContext, node: str, payload: bytes) -> float | None:
    """This node's rate in Gbit/s, or None when Redis is not there to measure against."""
    if ctx.store is None:
        return None
    # Well inside the hang timeout: the other ranks wait for this write in a collective.
    ft = getattr(ctx.spec, "fault_tolerance", None)
    limit = min(WRITE_TIMEOUT_S, ft.hang_timeout_s / 3) if ft is not None else WRITE_TIMEOUT_S
    try:
        with ctx.phase("link_probe"):
            took, finished = timed_write(ctx.store, ctx.job_id, node, payload, limit)
    except Exception as exc:  # noqa: BLE001 -- a probe never fails training
        ctx.log(f"link probe from node {node} failed ({exc}); its rate is left out",
                level="WARNING")
        return None
    gbps = len(payload) * 8 / max(took, 1e-9) / 1e9
    if not finished:  # the slowest link of all: counted at the most it can be
        ctx.log(f"link probe from node {node}: {len(payload) >> 20} MiB did not reach Redis "
                f"within {limit:.0f}s; its rate is at most {gbps:.3g} Gbit/s",
                level="WARNING")
    return gbps


def straggler_event(node: str, result: dict[str, Any],
                    shares: tuple[float | None, float | None]) -> dict[str, Any]:
    """The `straggler` event for one slow node of `result`; `shares`: the communication
    share at the baseline and now (either None when not known)."""
    gbps, best = result["rates"][node], result["best_gbps"]
    before, now = shares
    message = (f"node {node}'s link measured {gbps:.3g} Gbit/s to the control plane, against "
               f"{best:.3g} for the best node")
    if before is not None and now is not None:
        message += f"; the job's communication share rose from {before:.0%} to {now:.0%}"
    event = {"ts": result["at"], "type": "straggler", "node": node, "gbps": gbps,
             "best_gbps": best, "comm_share": now, "message": message + ": a slow link (straggler)"}
    if before is not None:
        event["comm_share_before"] = before
    return event


def _report(ctx: TrainContext, result: dict[str, Any], before: set[str],
            trigger: CommTrigger | None) -> None:
    """Rank 0: a `straggler` event per node newly found slow (a node that stays slow is
    not reported again at each probe), and a log line either way."""
    rates = {n: round(r, 3) if r is not None else None for n, r in result["rates"].items()}
    if not result["slow"]:
        ctx.log(f"link probe: no slow link; Gbit/s by node {rates}", link_rates=rates)
        return
    level = trigger.current() if trigger is not None else None
    shares = (trigger.baseline_share if trigger is not None else None,
              level[1] if level is not None else None)
    for node in result["slow"]:
        event = straggler_event(node, result, shares)
        ctx.log(event["message"], level="WARNING", straggler=node, link_rates=rates)
        if node in before or ctx.store is None:
            continue
        try:
            ctx.store.add_event(ctx.job_id, event)
        except Exception as exc:  # noqa: BLE001 -- bookkeeping; training goes on
            ctx.log(f"could not record the straggler event: {exc}", level="WARNING")
