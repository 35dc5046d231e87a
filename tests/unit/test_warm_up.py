"""A warm spare's warm-up step (workers/runtime/warm_up.py): it must leave the process as
a rank needs to find it, its global random state untouched and CUDA not started (the GPUs
are known only when the spare adopts a rank)."""

import torch

from kuangchao.workers.runtime import warm_up


def test_the_warm_up_step_keeps_the_random_state_and_never_starts_cuda(monkeypatch):
    def no_cuda(*_a, **_k):
        raise AssertionError("the warm-up started CUDA before the spare knew its GPUs")

    monkeypatch.setattr(torch.cuda, "_lazy_init", no_cuda)
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    expected = torch.rand(3)
    torch.random.set_rng_state(before)
    warm_up.exercise()
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(torch.rand(3), expected)
