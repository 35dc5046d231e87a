"""The router of the mixture of experts against hand-computed values: capacity, the order in
which assignments queue and are dropped (global, whatever the ranks), the load-balancing
and z-losses with their per-rank gradient shares, and the layer's drops and statistics."""

from __future__ import annotations

import math

import pytest
import torch

from kuangchao.workers.models.config import ModelConfig
from kuangchao.workers.models.moe import MoE, MoELayer, MoEState, moe_stats
from kuangchao.workers.models.router import (
    GlobalCounts,
    balance_terms,
    capacity,
    keep_mask,
    queue_positions,
    route,
    summary,
)

LN3 = math.log(3.0)


def _routing(logits: list[list[float]], top_k: int = 1):
    """Route tokens whose router logits are `logits`: x = I, the router weight = logits^T."""
    table = torch.tensor(logits, dtype=torch.float32)
    return route(torch.eye(len(logits)), table.t().contiguous(), top_k)


@pytest.mark.parametrize("tokens, experts, k, factor, want", [
    (10, 4, 2, 1.25, 7),   # 1.25 * 10 * 2 / 4 = 6.25, rounded up
    (8, 4, 2, 1.0, 4),
    (16, 8, 1, 1.0, 2),
    (3, 4, 1, 1.0, 1),     # 0.75 -> 1: an expert always takes one
    (8, 4, 2, 2.0, 8),     # factor >= E / k: nothing can be dropped
])
def test_capacity_is_the_ceiling_of_factor_times_an_even_share(tokens, experts, k, factor, want):
    assert capacity(tokens, experts, k, factor) == want


def test_assignments_queue_per_expert_in_token_order():
    experts = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 3]])
    assert queue_positions(experts, 4).tolist() == [[0, 0], [1, 0], [1, 2], [3, 0]]
    # One assignment to expert 0 came from an earlier rank; capacity 3: tokens 2 and 3
    # lose their expert-0 assignment (places 3 and 4), everything else fits.
    keep = keep_mask(experts, torch.tensor([1, 0, 0, 0]), 3)
    assert keep.tolist() == [[True, True], [True, True], [True, False], [False, True]]


def test_the_ranks_drop_exactly_the_assignments_one_process_drops_on_their_tokens():
    torch.manual_seed(0)
    x, weight = torch.randn(12, 8), torch.randn(4, 8)
    whole = route(x, weight, 2)
    cap = capacity(12, 4, 2, 0.75)
    want = keep_mask(whole.experts, torch.zeros(4, dtype=torch.long), cap)
    parts = [route(x[:5], weight, 2), route(x[5:9], weight, 2), route(x[9:], weight, 2)]
    table = torch.stack([summary(r) for r in parts])
    got = []
    for rank, r in enumerate(parts):
        glob = GlobalCounts(table, rank)
        assert glob.tokens == 12 and glob.load().tolist() == GlobalCounts(
            summary(whole).unsqueeze(0), 0).load().tolist()
        got.append(keep_mask(r.experts, glob.offsets(), cap))
        assert glob.kept(cap)[rank].tolist() == torch.bincount(
            r.experts[got[-1]], minlength=4).tolist()
    assert torch.cat(got).tolist() == want.tolist()
    assert not want.all(), "the case must drop something"


def test_kept_counts_fill_each_expert_rank_by_rank():
    # Two ranks, two experts, capacity 4: rank 0 keeps 3 and 1, rank 1 the 1 and 2 left.
    table = torch.zeros(2, 6, dtype=torch.float64)
    table[:, :2] = torch.tensor([[3.0, 1.0], [2.0, 2.0]])
    table[:, -1] = torch.tensor([2.0, 2.0])
    assert GlobalCounts(table, 1).kept(4).tolist() == [[3, 1], [1, 2]]
    assert GlobalCounts(table, 1).offsets().tolist() == [3, 1]


def test_router_gates_are_the_top_k_probabilities_renormalised():
    r = _routing([[0.0, LN3, 0.0]], top_k=2)  # probabilities 1/5, 3/5, 1/5
    assert r.experts[0, 0].item() == 1
    assert r.weights[0].tolist() == pytest.approx([0.75, 0.25])
    assert r.probs[0].tolist() == pytest.approx([0.2, 0.6, 0.2])


@pytest.mark.parametrize("logits, aux", [
    ([[0.0, LN3], [LN3, 0.0]], 1.0),   # one token each way: f = P = (1/2, 1/2), E * 2/4 = 1
    ([[0.0, LN3], [0.0, LN3]], 1.5),   # both to expert 1: f = (0, 1), P = (1/4, 3/4): 2 * 3/4
])
def test_the_load_balancing_loss_is_n_experts_times_share_times_mean_probability(logits, aux):
    r = _routing(logits)
    glob = GlobalCounts(summary(r).unsqueeze(0), 0)
    assert glob.aux_loss(1) == pytest.approx(aux)
    term, _ = balance_terms(r, glob, 1, dp=1)
    assert float(term) == pytest.approx(aux)


def test_the_z_loss_is_the_mean_squared_logsumexp():
    r = _routing([[0.0, LN3], [0.0, 0.0]])  # logsumexp: ln 4, ln 2
    glob = GlobalCounts(summary(r).unsqueeze(0), 0)
    want = (math.log(4) ** 2 + math.log(2) ** 2) / 2
    assert glob.z_loss() == pytest.approx(want)
    _, z = balance_terms(r, glob, 1, dp=1)
    assert float(z) == pytest.approx(want)


def test_each_ranks_share_averages_to_the_global_losses_gradient():
    torch.manual_seed(1)
    x, w = torch.randn(8, 6), torch.randn(4, 6)
    whole_w = w.clone().requires_grad_()
    r = route(x, whole_w, 2)
    aux, z = balance_terms(r, GlobalCounts(summary(r).unsqueeze(0), 0), 2, dp=1)
    (aux + z).backward()
    halves = (x[:4], x[4:])
    table = torch.stack([summary(route(rows, w, 2)) for rows in halves])
    grads = []
    for rank, rows in enumerate(halves):  # two data-parallel ranks, each its own router copy
        part_w = w.clone().requires_grad_()
        a, b = balance_terms(route(rows, part_w, 2), GlobalCounts(table, rank), 2, dp=2)
        (a + b).backward()
        grads.append(part_w.grad)
    assert torch.allclose((grads[0] + grads[1]) / 2, whole_w.grad, rtol=1e-5, atol=1e-7)


def _layer(factor: float, experts: int = 4, k: int = 2, aux: float = 0.0, z: float = 0.0):
    cfg = ModelConfig("moe", 1, 2, 8, 8, 16, n_experts=experts, top_k=k, capacity_factor=factor,
                      aux_loss_coef=aux, z_loss_coef=z)
    torch.manual_seed(2)
    return MoELayer(cfg, MoEState(experts))


def test_a_token_over_capacity_in_every_expert_gets_a_zero_output_and_stats_count_it():
    layer = _layer(factor=0.25)  # capacity ceil(0.25 * 6 * 2 / 4) = 1 per expert
    x = torch.randn(1, 6, 8)
    out = layer(x)
    r = route(x.reshape(-1, 8), layer.router.weight, 2)
    keep = keep_mask(r.experts, torch.zeros(4, dtype=torch.long), 1)
    dropped = ~keep.any(1)
    assert dropped.any() and keep.any()
    assert (out[0][dropped] == 0).all() and (out[0][~dropped] != 0).any()
    stats = layer.state.stats()
    assert sum(stats["expert_load"]) == 12  # 6 tokens x top 2
    assert stats["dropped_tokens"] == 12 - int(keep.sum()) == sum(max(0, n - 1) for n in
                                                                 stats["expert_load"])


def test_the_auxiliary_losses_reach_the_router_gradient_scaled_as_the_loss():
    plain, coef = _layer(1.0), _layer(1.0, aux=0.5, z=0.25)
    x = torch.randn(2, 5, 8)
    plain(x).sum().backward()
    coef.state.grad_scale = 0.5
    coef(x).sum().backward()
    r = route(x.reshape(-1, 8), coef.router.weight, 2)
    aux, z = balance_terms(r, GlobalCounts(summary(r).unsqueeze(0), 0), 2, dp=1)
    extra = torch.autograd.grad(0.5 * (0.5 * aux + 0.25 * z), coef.router.weight)[0]
    assert torch.allclose(coef.router.weight.grad, plain.router.weight.grad + extra, atol=1e-6)
    for a, b in zip(plain.experts.parameters(), coef.experts.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_the_model_reports_the_last_steps_routing_and_every_expert_has_a_gradient():
    cfg = ModelConfig("moe", 2, 2, 16, 8, 32, n_experts=4, top_k=2, capacity_factor=1.0)
    torch.manual_seed(3)
    model = MoE(cfg)
    idx = torch.randint(0, 32, (3, 9))
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    stats = model.moe_stats()
    assert stats == moe_stats(model)
    assert sum(stats["expert_load"]) == 2 * 24 * 2  # 2 layers x 24 tokens x top 2
    assert stats["aux_loss"] >= 1.0 - 1e-6  # at least 1, reached by an even load
    assert stats["z_loss"] > 0
    assert all(p.grad is not None for p in model.parameters())
    model.reset_moe_stats()
    with torch.no_grad():
        model.eval()
        model(idx[:, :-1])
    assert model.moe_stats()["expert_load"] == [0, 0, 0, 0]  # evaluation is not counted
