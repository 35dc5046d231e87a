"""A mixture of experts' routing at a job's last logged step: what rank 0 reports,
and what `/metrics` serves of it.

At every logged step the built-in trainer adds the MoE model's `moe_stats()`
(workers/models/moe.py) to rank 0's progress report under `moe`
(`progress_fields`); the API's collector reads it back from the job's progress at
each scrape (`RoutingStats.parse`, api/server/moe_metrics.py), as it reads the
loss, and serves per job:

* `kc_job_expert_load_tokens{job, expert}`: (token, expert) assignments the router
  made to each expert over the whole global batch of the step, before capacity;
* `kc_job_expert_imbalance_ratio{job}`: the busiest expert's load over the mean
  (1 when the router is even; the step's experts wait for the busiest one);
* `kc_job_moe_dropped_tokens{job}`: assignments over capacity, dropped;
* `kc_job_moe_aux_loss{job}` and `kc_job_moe_z_loss{job}`: the load-balancing and
  router z-losses, before their coefficients.

All are gauges of the last logged step, not counters: rank 0 sees only the
steps it logs (every `training.log_interval`), so a running total would miss
the ones between. Under a pipeline, rank 0 counts its own stage's MoE layers.

Labels stay bounded: `expert` runs over 0 .. n_experts - 1 of the job's
validated spec (at most 1024, platform/spec/model.py), one series per expert
per active MoE job. The progress hash is in the job's own key space, which its
ranks can write, so a report whose load is not exactly `n_experts` finite,
non-negative counts is not served at all.

The job JSON shows the same under `progress.moe` (`routing_view`), with the imbalance.

Pure: no Redis, no torch (a 0-d tensor converts through `float`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kuangchao.platform.spec.defaults import value

PROGRESS_KEY = "moe"


def _count(value: Any) -> float | None:
    """A finite, non-negative number (bools refused), else None."""
    if isinstance(value, bool):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) and out >= 0 else None


@dataclass(frozen=True)
class RoutingStats:
    """One step's routing over every rank (the shape `moe_stats()` returns)."""

    expert_load: tuple[float, ...]
    dropped_tokens: float
    aux_loss: float
    z_loss: float

    @property
    def imbalance(self) -> float | None:
        """The busiest expert's load over the mean; None when nothing was routed."""
        total = sum(self.expert_load)
        if not self.expert_load or total <= 0:
            return None
        return max(self.expert_load) / (total / len(self.expert_load))

    def to_json(self) -> dict[str, Any]:
        return {"expert_load": [int(v) if v == int(v) else v for v in self.expert_load],
                "dropped_tokens": int(self.dropped_tokens) if self.dropped_tokens == int(self.dropped_tokens)
                else self.dropped_tokens,
                "aux_loss": self.aux_loss, "z_loss": self.z_loss}

    @classmethod
    def parse(cls, raw: Any, n_experts: int | None = None) -> RoutingStats | None:
        """From a report (`moe_stats()`, or the progress' `moe`); None when `raw` is not
        one: a missing field, a number that is not finite and non-negative, or (given
        `n_experts`) a load of another length."""
        if not isinstance(raw, Mapping):
            return None
        load = raw.get("expert_load")
        if not isinstance(load, list | tuple) or not load:
            return None
        if n_experts is not None and len(load) != n_experts:
            return None
        counts = [_count(v) for v in load]
        scalars = [_count(raw.get(k)) for k in ("dropped_tokens", "aux_loss", "z_loss")]
        if any(v is None for v in counts) or any(v is None for v in scalars):
            return None
        dropped, aux, z = scalars
        return cls(tuple(counts), dropped, aux, z)  # type: ignore[arg-type]


def job_routing(spec: Mapping[str, Any], progress: Mapping[str, Any]) -> RoutingStats | None:
    """A job's last reported routing, from its stored spec and its progress: None for a
    dense job, before its first logged step, or for a report its spec's `model.n_experts`
    does not match."""
    if value(spec, "model", "type") != "moe":
        return None
    n_experts = value(spec, "model", "n_experts")
    if not isinstance(n_experts, int) or isinstance(n_experts, bool):
        return None
    return RoutingStats.parse(progress.get(PROGRESS_KEY), n_experts)


def routing_view(spec: Mapping[str, Any], progress: Mapping[str, Any]) -> dict[str, Any] | None:
    """The job JSON's `progress.moe`: the last routing with its `imbalance`, or None."""
    stats = job_routing(spec, progress)
    return None if stats is None else {**stats.to_json(), "imbalance": stats.imbalance}


def progress_fields(stats: Any) -> dict[str, Any]:
    """`{"moe": ...}` for a progress report, from a model's `moe_stats()` (None for a dense
    model); empty when there is nothing well-formed to report."""
    parsed = RoutingStats.parse(stats)
    return {} if parsed is None else {PROGRESS_KEY: parsed.to_json()}
