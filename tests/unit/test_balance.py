"""Balanced work on mixed GPU generations: the arithmetic, the emulated slowdown, and the
gradient weighting that keeps an uneven split's math equal to an even one's."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch

from kuangchao.platform.spec.parallel import ParallelSection
from kuangchao.workers.data.sampling import batch_indices
from kuangchao.workers.data.shares import Shares, split_counts
from kuangchao.workers.errors import DataError, TrainingError
from kuangchao.workers.parallel import emulation as emu_mod
from kuangchao.workers.parallel.balance import (
    catalogue_speed,
    dp_shares,
    measured_shares,
    rank_speeds,
    replica_speeds,
    share_cut,
    speeds_differ,
    stage_speeds,
    stage_split,
)
from kuangchao.workers.parallel.emulation import Emulation, check_emulation
from kuangchao.workers.parallel.layout import Layout

# -- the data-parallel split ---------------------------------------------------------


def test_split_counts_is_proportional_exact_and_sums_to_the_total():
    assert split_counts([1.0, 0.5], 24) == (16, 8)
    assert split_counts([2.0, 1.0, 1.0], 10) == (5, 3, 2)  # remainders tie: the first wins
    assert split_counts([1.0, 1.0, 1.0], 9) == (3, 3, 3)
    assert split_counts([1.0, 0.5], 24, unit=4, minimum=1) == (16, 8)
    assert split_counts([1.0, 0.01], 8) == (7, 1)  # never below the minimum
    assert split_counts([1.0, 0.01, 0.01], 12, unit=4) == (4, 4, 4)
    rng = random.Random(3)
    for _ in range(300):
        n = rng.randint(1, 6)
        weights = [rng.uniform(0.05, 3.0) for _ in range(n)]
        total = rng.randint(n, 200)
        parts = split_counts(weights, total)
        assert sum(parts) == total and min(parts) >= 1
        # largest remainder: no part is a whole sample or more off its quota unless lifted to 1
        quota = [total * w / sum(weights) for w in weights]
        assert all(p == 1 or abs(p - q) < 1 + 1e-9 for p, q in zip(parts, quota, strict=True))


def test_split_counts_refuses_what_cannot_be_split():
    with pytest.raises(DataError, match="positive"):
        split_counts([1.0, 0.0], 8)
    with pytest.raises(DataError, match="units of 4"):
        split_counts([1.0, 1.0], 10, unit=4)
    with pytest.raises(DataError, match="cannot give 3 ranks"):
        split_counts([1.0, 1.0, 1.0], 2)


@pytest.mark.parametrize("dp,mb,accum", [(1, 4, 1), (2, 4, 3), (3, 2, 2), (4, 1, 5)])
def test_equal_shares_are_batch_indices_exactly(dp, mb, accum):
    shares = Shares.even(dp, mb, accum)
    assert shares.is_even and shares.loss_scales(0) is None and shares.weight(dp - 1) == 1.0
    for step, r in itertools.product(range(3), range(dp)):
        assert shares.spans(step, r) == [batch_indices(step, m, r, dp, mb, accum)
                                         for m in range(accum)]
    # equal speeds, whatever their value, give the even split
    layout = Layout(dp)
    p = ParallelSection(data_parallel_size=dp, micro_batch_size=mb, gradient_accumulation_steps=accum)
    assert dp_shares([0.37] * dp, layout, p, accum) == shares


@pytest.mark.parametrize("cut", ["own", "common", "units"])
def test_uneven_shares_partition_each_block_into_bounded_micro_batches(cut):
    counts = (16, 8) if cut == "units" else (17, 5, 2)
    shares = Shares(counts, micro_batch_size=4, accum_steps=2 if cut == "units" else 2, cut=cut) \
        if cut != "units" else Shares(counts, 4, 3, cut)
    g = shares.global_batch
    for step in range(3):
        seen = []
        for r in range(shares.dp_size):
            spans = shares.spans(step, r)
            sizes = [len(s) for s in spans]
            assert sizes == shares.sizes(r) and sum(sizes) == counts[r]
            assert max(sizes) <= 4
            seen += [i for s in spans for i in s]
        assert sorted(seen) == list(range(step * g, (step + 1) * g)) and len(set(seen)) == g
    if cut == "own":
        assert [len(shares.sizes(r)) for r in range(3)] == [5, 2, 1]
        assert shares.sizes(0) == [4, 4, 3, 3, 3]
    if cut == "common":  # FSDP: every rank as many micro-batches, some possibly empty
        assert {len(shares.sizes(r)) for r in range(3)} == {5}
        assert shares.sizes(2) == [1, 1, 0, 0, 0]
    if cut == "units":
        assert shares.sizes(0) == [4, 4, 4, 4] and shares.sizes(1) == [4, 4]


def test_loss_scales_and_weights_make_the_global_mean():
    """With any per-sample losses: the micro-batch means scaled by `loss_scales`, averaged
    over the ranks as DDP averages gradients, and the rank means weighted by `weight`,
    averaged as the trainer's all-reduce does, are both the global batch's mean."""
    shares = Shares((17, 5, 2), 4, 2)
    rng = random.Random(2)
    per_sample = [rng.uniform(0.5, 5.0) for _ in range(shares.global_batch)]
    want = sum(per_sample) / len(per_sample)
    by_scales, by_weights = 0.0, 0.0
    for r in range(shares.dp_size):
        spans = shares.spans(0, r)
        means = [sum(per_sample[i] for i in s) / len(s) for s in spans]
        by_scales += sum(m * k for m, k in zip(means, shares.loss_scales(r), strict=True))
        rank_mean = sum(per_sample[i] for s in spans for i in s) / shares.counts[r]
        by_weights += rank_mean * shares.weight(r)
    assert by_scales / shares.dp_size == pytest.approx(want, rel=1e-12)
    assert by_weights / shares.dp_size == pytest.approx(want, rel=1e-12)


def test_shares_refuse_bad_counts():
    with pytest.raises(DataError, match="sum to the global batch"):
        Shares((5, 4), 4, 1)
    with pytest.raises(DataError, match="whole micro-batches"):
        Shares((6, 2), 4, 1, "units")


# -- speeds and the layouts ----------------------------------------------------------


def test_rank_speeds_emulated_then_catalogue_then_equal():
    h100, a100 = catalogue_speed("h100-80gb"), catalogue_speed("a100-80gb")
    assert h100 == 989e12 * 0.5 and a100 == 312e12 * 0.6
    assert catalogue_speed("no-such-gpu") is None and catalogue_speed(None) is None
    # an emulated cluster compares emulated speeds only; a node without one is full speed
    assert rank_speeds([(0.0, h100), (0.5, a100)]) == [1.0, 0.5]
    assert rank_speeds([(0.0, h100), (0.0, a100)]) == [h100, a100]
    assert rank_speeds([(0.0, h100), (0.0, 0.0)]) == [h100, h100]  # unknown: the slowest known
    assert rank_speeds([(0.0, 0.0), (0.0, 0.0)]) == [1.0, 1.0]


def test_a_replica_and_a_stage_move_at_their_slowest_rank():
    layout = Layout(dp=2, pp=2, tp=2)  # rank = (dp * pp + stage) * tp + t
    speeds = [1.0, 0.9, 1.0, 1.0, 0.5, 0.5, 0.4, 0.5]
    assert replica_speeds(speeds, layout) == [0.9, 0.4]
    assert stage_speeds(speeds, layout) == [0.5, 0.4]


def _brute(n, speeds):
    """The least slowest-stage time over every split of n layers, each stage >= 1."""
    return min(max(a / s for a, s in zip(split, speeds, strict=True))
               for split in itertools.product(range(1, n + 1), repeat=len(speeds))
               if sum(split) == n)


def test_stage_split_minimises_the_slowest_stage_exactly():
    assert stage_split(6, [1.0, 0.5]) == (4, 2)
    assert stage_split(8, [1.0, 1.0]) == (4, 4)
    assert stage_split(12, [0.3] * 4) == (3, 3, 3, 3)
    assert stage_split(4, [1.0, 0.01]) == (3, 1)  # every stage keeps a layer
    rng = random.Random(5)
    for _ in range(200):
        k = rng.randint(1, 4)
        speeds = [rng.choice([0.25, 0.5, 0.6, 1.0, 1.7]) for _ in range(k)]
        n = rng.randint(k, 10)
        got = stage_split(n, speeds)
        assert sum(got) == n and min(got) >= 1
        assert max(a / s for a, s in zip(got, speeds, strict=True)) == _brute(n, speeds), \
            (n, speeds, got)
    with pytest.raises(ValueError, match="one each"):
        stage_split(2, [1.0, 1.0, 1.0])


def test_which_layouts_balance_their_replicas():
    lay = Layout(dp=2)
    assert share_cut(ParallelSection(data_parallel_size=2), lay) == "own"
    assert share_cut(ParallelSection(data_parallel_size=2, zero_stage=3), lay) == "common"
    pp = Layout(dp=2, pp=2)
    assert share_cut(ParallelSection(data_parallel_size=2, pipeline_parallel_size=2), pp) == "units"
    assert share_cut(ParallelSection(data_parallel_size=2, pipeline_parallel_size=2,
                                     zero_stage=2), pp) is None
    p = ParallelSection(data_parallel_size=2, pipeline_parallel_size=2, micro_batch_size=2,
                        gradient_accumulation_steps=4)
    got = dp_shares([1.0, 1.0, 0.5, 0.5], pp, p, 4)
    assert got.counts == (10, 6) and got.cut == "units"  # whole micro-batches, >= 2 (pp) each
    assert dp_shares([1.0, 1.0, 0.5, 0.5], pp, p, 4, balance="even").is_even


def test_measured_speeds_rebalance_only_past_the_threshold():
    layout = Layout(dp=2)
    current = Shares((16, 8), 4, 3)
    # measured as the split assumed: 1 s and 2 s per sample -> keep
    assert measured_shares(current, [1.0, 2.02], layout, "own") is None
    # 1.8x: the proportional counts are 15.4 and 8.6, within 10% of 16 and 8 -> keep
    assert measured_shares(current, [1.0, 1.8], layout, "own") is None
    # the slow rank is really 3x slower -> 18 / 6
    new, speeds = measured_shares(current, [1.0, 3.0], layout, "own")
    assert new.counts == (18, 6) and speeds == pytest.approx([1.0, 1 / 3])
    # equal measurements bring an uneven split back to the even one, batch_indices and all
    new, _ = measured_shares(current, [1.0, 1.0], layout, "own")
    assert new == Shares.even(2, 4, 3)


# -- emulation -----------------------------------------------------------------------


class _Clock:
    def __init__(self, times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0)


def test_emulation_sleeps_the_computed_multiple_of_cpu_time(monkeypatch):
    slept = []
    monkeypatch.setattr(emu_mod.time, "sleep", slept.append)
    monkeypatch.setattr(emu_mod.time, "thread_time", _Clock([10.0, 10.3]))
    e = Emulation(0.25)
    assert e.delay(0.2) == pytest.approx(0.6) and Emulation(1.0).delay(5.0) == 0.0
    with e.timed():
        pass
    assert slept == [pytest.approx(0.9)] and e.slept == pytest.approx(0.9)


def test_chunk_markers_time_a_chunk_backward(monkeypatch):
    slept = []
    monkeypatch.setattr(emu_mod.time, "sleep", slept.append)
    e = Emulation(0.5)
    clock = e.clock()
    x = torch.ones(3, requires_grad=True)
    h = e.open(x * 2, clock)
    out = e.close((h * h).sum(), clock)
    monkeypatch.setattr(emu_mod.time, "thread_time", _Clock([5.0, 5.25]))
    out.backward()
    assert slept == [pytest.approx(0.25)]  # (1/0.5 - 1) x the 0.25 s between the markers
    assert torch.equal(x.grad, torch.full((3,), 8.0))  # the markers are identities


def test_emulation_is_refused_where_cuda_is():
    assert check_emulation(None, cuda=True) is None
    assert check_emulation(1.0, cuda=True) is None  # full speed: nothing to emulate
    assert check_emulation(0.5, cuda=False) == 0.5
    with pytest.raises(TrainingError, match="emulated_speed 0.5 on node gpu-1.*CUDA"):
        check_emulation(0.5, cuda=True, node="gpu-1")
    with pytest.raises(TrainingError, match="emulated_speed 1.5"):
        check_emulation(1.5, cuda=False)


# -- the gradient weighting ------------------------------------------------------------


def _tiny():
    from kuangchao.workers.models.factory import ModelConfig, build_model
    from kuangchao.workers.parallel.pipeline import build_chunks

    torch.manual_seed(0)
    model = build_model(ModelConfig(type="gpt", n_layers=2, n_heads=2, d_model=16, seq_len=8,
                                    vocab_size=32))
    return model, build_chunks(model, 1, [0], recompute=False)[0]


def _rank_grads(shares, r, rows):
    """What `accumulate` leaves on data-parallel rank r for its share of `rows`."""
    from kuangchao.workers.parallel.engine import Engine
    from kuangchao.workers.parallel.microbatch import ComputeClock, accumulate
    from kuangchao.workers.parallel.precision import Precision

    model, chunk = _tiny()
    batches = [(rows[s.start:s.stop, :-1], rows[s.start:s.stop, 1:]) for s in shares.spans(0, r)]
    fake = SimpleNamespace(wrapped=[chunk], shares=None if shares.is_even else shares,
                           coords=SimpleNamespace(dp=r), emulation=None, fsdp=False,
                           precision=Precision("fp32", torch.device("cpu"), autocast=True))
    fake._no_sync = lambda module, last: Engine._no_sync(fake, module, last)
    loss = accumulate(fake, batches, False, ComputeClock(torch.device("cpu"), None))
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("counts", [(6, 2), (7, 1), (3, 5)])
def test_an_uneven_split_weighted_by_samples_gives_the_even_split_gradients(counts):
    torch.manual_seed(1)
    rows = torch.randint(0, 32, (8, 9))
    results = {}
    for name, shares in (("even", Shares.even(2, 2, 2)), ("uneven", Shares(counts, 2, 2))):
        per_rank = [_rank_grads(shares, r, rows) for r in range(2)]
        # DDP averages the gradients over the data-parallel group; the trainer the weighted losses
        grads = {n: (per_rank[0][1][n] + per_rank[1][1][n]) / 2 for n in per_rank[0][1]}
        loss = sum(per_rank[r][0] * shares.weight(r) for r in range(2)) / 2
        results[name] = (loss, grads)
    model, chunk = _tiny()
    from kuangchao.workers.parallel.pipeline import lm_loss

    whole = lm_loss(chunk(rows[:, :-1]), rows[:, 1:])
    whole.backward()
    for name in ("even", "uneven"):
        loss, grads = results[name]
        assert loss == pytest.approx(float(whole.detach()), rel=1e-6)
        want = {n: p.grad for n, p in model.named_parameters()}
        assert _rel(grads, want) <= 1e-6, (name, _rel(grads, want))
    assert _rel(results["uneven"][1], results["even"][1]) <= 1e-6


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Relative difference of two whole gradients, by norm (some entries, such as the key
    bias's, are zero up to rounding, so element by element says nothing)."""
    fa = torch.cat([a[n].flatten() for n in sorted(b)])
    fb = torch.cat([b[n].flatten() for n in sorted(b)])
    return float((fa - fb).norm() / fb.norm())


# -- a rank's hardware -----------------------------------------------------------------


def test_a_rank_takes_its_nodes_hardware_from_the_controller_else_the_environment(monkeypatch):
    from kuangchao.platform.cluster import registry
    from kuangchao.platform.cluster.topology import NodeInfo
    from kuangchao.platform.execution.spares import node_hardware_view
    from kuangchao.workers.runtime.worker import node_hardware

    nodes = (NodeInfo("node-h1", 1, ((0,),), "leaf-0", gpu_type="h100-80gb"),
             NodeInfo("node-a1", 1, ((0,),), "leaf-0", gpu_type="a100-80gb", emulated_speed=0.5))
    monkeypatch.setattr(registry, "current_nodes", lambda store=None: nodes)
    controller_side = node_hardware_view().get
    assert controller_side("node-a1") == {"gpu_type": "a100-80gb", "emulated_speed": 0.5}
    assert controller_side("node-h1") == {"gpu_type": "h100-80gb", "emulated_speed": None}
    assert controller_side("elsewhere") is None

    monkeypatch.setenv("KC_GPU_TYPE", "a100-80gb")
    monkeypatch.setenv("KC_EMULATED_SPEED", "0.5")
    given = {"gpu_type": "h100-80gb", "emulated_speed": None}
    assert node_hardware(given) == given  # the controller's word wins
    assert node_hardware(None) == {"gpu_type": "a100-80gb", "emulated_speed": 0.5}
    monkeypatch.setenv("KC_EMULATED_SPEED", "half")
    with pytest.raises(TrainingError, match="KC_EMULATED_SPEED='half'"):
        node_hardware(None)


def test_only_a_group_of_unequal_speeds_is_measured():
    # Equal GPUs (or no type known): even, bit for bit; noise moves nothing.
    assert not speeds_differ([1.0, 1.0, 1.0, 1.0])
    assert not speeds_differ([494.5e12] * 3)
    assert not speeds_differ([2.0])
    assert not speeds_differ([])
    # A mix of types, or a node emulating half speed: measured.
    assert speeds_differ([494.5e12, 187.2e12])
    assert speeds_differ([1.0, 1.0, 0.5, 1.0])
