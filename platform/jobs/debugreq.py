"""Asking a running job's ranks for a diagnosis, and reading their answers.

`kc debug` and `kc profile` post a request to the job's key space; every
rank answers into one hash, keyed by rank:

- `comm` and `memory` are answered by each rank's heartbeat thread, at once,
  even while the train loop is blocked inside a collective (the case where
  the answer matters most: a deadlock).
- `gradient` and `profile` need every rank at the same step: rank 0 sees the
  request with its heartbeat, all ranks agree on it in the small all-reduce
  they already run each step (`TrainContext.control`), then capture at the
  next step (or at `step`, when asked for one).

The comparisons here are pure: the API hands them the answers.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import asdict, dataclass
from typing import Any

KINDS = ("comm", "memory", "gradient", "profile")
SYNCED_KINDS = ("gradient", "profile")  # captured by every rank at one agreed step
ANSWER_TTL_S = 3600


@dataclass(frozen=True)
class DebugRequest:
    id: str
    kind: str
    step: int | None = None  # gradient: the step to capture (None: the next one)
    steps: int = 1  # profile: how many steps to record
    ts: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes | None) -> DebugRequest | None:
        if not raw:
            return None
        try:
            d = json.loads(raw)
            return cls(id=str(d["id"]), kind=str(d["kind"]), step=d.get("step"),
                       steps=int(d.get("steps") or 1), ts=float(d.get("ts") or 0))
        except (ValueError, KeyError, TypeError):
            return None


def new_request(kind: str, step: int | None = None, steps: int = 1) -> DebugRequest:
    """A fresh request of `kind`; the store posts it (`post_debug`), replacing any earlier one."""
    if kind not in KINDS:
        raise ValueError(f"unknown debug kind {kind!r}; choose one of {', '.join(KINDS)}")
    return DebugRequest(secrets.token_hex(6), kind, step, steps, time.time())


def parse_answers(raw: dict[str, str]) -> dict[int, dict]:
    """rank -> answer, from the stored rank -> JSON text; what does not parse is left out."""
    out = {}
    for rank, text in raw.items():
        try:
            out[int(rank)] = json.loads(text)
        except (TypeError, ValueError):
            continue
    return out


# -- what the API makes of the answers ------------------------------------------------
def gradient_report(answers: dict[int, dict], top: int = 10) -> dict[str, Any]:
    """Compare every replica's gradients, parameter by parameter.

    Each rank sent, per parameter, `[norm, sum, max_abs, digest]` of its
    gradient after the data-parallel all-reduce, when every replica must hold
    the same bits. Divergence of a parameter: the largest relative distance of
    any rank's gradient norm from rank 0's (and 1.0 when only the bits differ,
    never 0 when they do).
    """
    if not answers:
        return {"ranks": 0, "step": None, "max_divergence": 0.0, "diverged": [], "identical": True}
    ranks = sorted(answers)
    ref = answers[ranks[0]].get("params", {})
    rows = []
    for name, (norm0, _sum0, _max0, digest0) in ref.items():
        worst, worst_rank = 0.0, None
        for r in ranks[1:]:
            other = answers[r].get("params", {}).get(name)
            if other is None:
                worst, worst_rank = math.inf, r
                break
            norm, _, _, digest = other
            if digest == digest0:
                continue
            scale = max(abs(norm0), abs(norm), 1e-12)
            rel = abs(norm - norm0) / scale
            rel = rel if rel > 0 else 1e-12  # the bits differ even where the norm agrees
            if rel > worst:
                worst, worst_rank = rel, r
        if worst_rank is not None:
            rows.append({"param": name, "divergence": worst, "rank": worst_rank,
                         "norm_rank0": norm0,
                         "norm_rank": (answers[worst_rank].get("params", {}).get(name) or [None])[0]})
    rows.sort(key=lambda x: -x["divergence"])
    steps = {answers[r].get("step") for r in ranks}
    return {"ranks": len(ranks), "step": min(s for s in steps if s is not None) if steps else None,
            "steps_agree": len(steps) == 1, "params": len(ref),
            "max_divergence": rows[0]["divergence"] if rows else 0.0,
            "identical": not rows, "diverged": rows[:top]}


def comm_report(answers: dict[int, dict], stuck_s: float = 5.0) -> dict[str, Any]:
    """Every rank's groups and collectives, with the inconsistencies that deadlock.

    A group is flagged when its ranks disagree on its members or their order
    (collectives then pair up the wrong peers and wait forever), and ranks are
    flagged when some have waited `stuck_s` or more in a collective that not all
    of them are in. (A healthy job is caught mid-collective all the time, for
    milliseconds.)
    """
    problems: list[str] = []
    views: dict[str, dict[int, list[int]]] = {}
    for rank, a in sorted(answers.items()):
        for g in a.get("groups", []):
            views.setdefault(g["name"], {})[rank] = list(g.get("ranks", []))
    for name, by_rank in views.items():
        orders = {tuple(v) for v in by_rank.values()}
        if len(orders) > 1:
            detail = "; ".join(f"rank {r}: {v}" for r, v in sorted(by_rank.items()))
            problems.append(f"group {name}: ranks disagree on its members or their order "
                            f"({detail})")
        members = set(next(iter(orders), ()))
        missing = sorted(members - set(by_rank))
        if missing and len(orders) == 1:
            problems.append(f"group {name}: rank(s) {missing} did not report it")
    pending = {r: a["pending"] for r, a in answers.items()
               if a.get("pending") and a["pending"].get("waited_s", 0) >= stuck_s}
    ops = {(p or {}).get("op") for p in pending.values()}
    if pending and (len(pending) < len(answers) or len(ops) > 1):
        idle = sorted(set(answers) - set(pending))
        problems.append("ranks wait in different collectives: " + "; ".join(
            f"rank {r}: {p['op']} on {p.get('group')} for {p.get('waited_s', 0):.1f}s"
            for r, p in sorted(pending.items())) + (f"; rank(s) {idle} in none" if idle else ""))
    return {"ranks": {r: answers[r] for r in sorted(answers)}, "problems": problems,
            "healthy": not problems, "slow_links": slow_links(answers)}


def _number(x: Any) -> float | int | None:
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def slow_links(answers: dict[Any, dict]) -> list[dict[str, Any]]:
    """The nodes the job's newest link probe found slow, from any rank's `links`:
    `{node, gbps, best_gbps, at}` each. A slow link is no inconsistency between the
    groups, so it leaves `healthy` alone. The answers come from the job's own code:
    what is not the shape a rank writes is left out rather than failing the report."""
    probes = [a["links"] for a in answers.values()
              if isinstance(a, dict) and isinstance(a.get("links"), dict)]
    if not probes:
        return []
    newest = max(probes, key=lambda p: _number(p.get("at")) or 0.0)
    rates = newest.get("rates") if isinstance(newest.get("rates"), dict) else {}
    slow = newest.get("slow") if isinstance(newest.get("slow"), list) else []
    return [{"node": node, "gbps": _number(rates.get(node)),
             "best_gbps": _number(newest.get("best_gbps")), "at": _number(newest.get("at"))}
            for node in slow if isinstance(node, str)]
