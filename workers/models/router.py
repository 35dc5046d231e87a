"""The router of a mixture of experts: top-k gating, expert capacity, and the auxiliary losses.

Pure tensor maths, shared by the single-process model and every parallel layout
(workers/models/moe.py runs it; workers/parallel/expert_parallel.py moves the
tokens). Its one rule that reaches across ranks is capacity:

* An expert takes at most `capacity(N, E, k, factor) = ceil(factor * N * k / E)`
  (token, expert) assignments per forward, where N counts the tokens of the
  *global* micro-batch: every data-parallel rank's current micro-batch together.
* Assignments queue for their expert in the global order: data-parallel rank by
  rank, then token by token within the rank. The first `capacity` are kept; the
  rest are dropped (their expert output is zero, and the block's residual carries
  the token on). Each rank learns the other ranks' per-expert counts (`summary`,
  gathered), so it needs nothing else to know which of its own assignments fit:
  the dropped tokens are the ones a single process would drop on the global
  micro-batch, whatever the layout.

The load-balancing loss (Switch Transformer, Mixtral) is
`E * sum_e f_e * P_e`, with `f_e` the share of the N*k assignments routed to
expert e (before capacity) and `P_e` the router's mean probability for e; it is
1 when the load is even. The router z-loss (ST-MoE) is the mean of
`logsumexp(logits)^2`. Both are global quantities; `balance_terms` gives each
rank the part whose gradient, averaged over the data-parallel ranks as every
gradient is, is the global loss's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def capacity(n_tokens: int, n_experts: int, top_k: int, factor: float) -> int:
    """The assignments each expert takes per forward: ceil(factor * N * k / E)."""
    return math.ceil(factor * n_tokens * top_k / n_experts)


@dataclass
class Routing:
    """One forward's routing of N tokens over E experts.

    Attributes:
        logits: [N, E] router logits, fp32.
        probs: [N, E] softmax over all experts.
        experts: [N, k] the chosen experts, best first (distinct per token).
        weights: [N, k] their probabilities renormalised to sum to 1 (Mixtral).
    """

    logits: torch.Tensor
    probs: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor


def route(x: torch.Tensor, weight: torch.Tensor, top_k: int) -> Routing:
    """Route tokens `x` [N, D] with the router's `weight` [E, D], in fp32 whatever the autocast."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        logits = F.linear(x.float(), weight.float())
    probs = logits.softmax(dim=-1)
    top, experts = probs.topk(top_k, dim=-1)
    return Routing(logits, probs, experts, top / top.sum(dim=-1, keepdim=True))


def summary(r: Routing) -> torch.Tensor:
    """What other ranks need of this one: [2E + 2] float64 = per-expert assignment counts,
    per-expert sums of router probabilities, the sum of logsumexp^2, and the token count."""
    n, e = r.probs.shape
    counts = torch.bincount(r.experts.flatten(), minlength=e).double()
    lse = torch.logsumexp(r.logits.detach(), dim=-1)
    return torch.cat([counts, r.probs.detach().double().sum(0),
                      (lse.double() ** 2).sum().reshape(1),
                      torch.tensor([float(n)], dtype=torch.float64, device=counts.device)])


@dataclass(frozen=True)
class GlobalCounts:
    """Every data-parallel rank's `summary`, rows in rank order, and this rank's row."""

    table: torch.Tensor  # [R, 2E + 2] float64
    rank: int

    @property
    def n_experts(self) -> int:
        return (self.table.shape[1] - 2) // 2

    @property
    def counts(self) -> torch.Tensor:
        """[R, E] int64: assignments each rank routed to each expert."""
        return self.table[:, :self.n_experts].round().long()

    @property
    def tokens(self) -> int:
        """Tokens in the global micro-batch."""
        return int(self.table[:, -1].sum().round())

    def offsets(self) -> torch.Tensor:
        """[E]: assignments the ranks before this one routed to each expert."""
        return self.counts[:self.rank].sum(0)

    def kept(self, cap: int) -> torch.Tensor:
        """[R, E]: of each rank's assignments to each expert, how many fit in `cap`."""
        counts = self.counts
        before = counts.cumsum(0) - counts
        return (cap - before).clamp(min=0).minimum(counts)

    def load(self) -> torch.Tensor:
        """[E] global assignments per expert (before capacity)."""
        return self.counts.sum(0)

    def aux_loss(self, top_k: int) -> float:
        """The global load-balancing loss (a value, for the metrics)."""
        n, e = self.tokens, self.n_experts
        frac = self.load().double() / max(1, n * top_k)
        mean_prob = self.table[:, e:2 * e].sum(0) / max(1, n)
        return float(e * (frac * mean_prob).sum())

    def z_loss(self) -> float:
        """The global router z-loss (a value, for the metrics)."""
        return float(self.table[:, -2].sum() / max(1, self.tokens))


def queue_positions(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[N, k]: how many of this rank's earlier tokens were routed to the same expert."""
    onehot = F.one_hot(experts, n_experts).sum(1)  # [N, E]; a token picks an expert once at most
    before = onehot.cumsum(0) - onehot
    return before.gather(1, experts)


def keep_mask(experts: torch.Tensor, offsets: torch.Tensor, cap: int) -> torch.Tensor:
    """[N, k] bool: whether each assignment's place in its expert's global queue is below `cap`."""
    return offsets[experts] + queue_positions(experts, offsets.numel()) < cap


def balance_terms(r: Routing, glob: GlobalCounts, top_k: int,
                  dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's differentiable shares of the global load-balancing and z-losses.

    Scaled by `dp / N_global` so that their gradients, averaged over the `dp`
    data-parallel ranks, are the global losses' (the token shares `f_e` are counts:
    they carry no gradient, here as in Switch Transformer)."""
    n, e = glob.tokens, glob.n_experts
    frac = glob.load().to(r.probs.dtype) / max(1, n * top_k)
    aux = e * (frac * r.probs.sum(0)).sum() * (dp / max(1, n))
    z = torch.logsumexp(r.logits, dim=-1).pow(2).sum() * (dp / max(1, n))
    return aux, z
