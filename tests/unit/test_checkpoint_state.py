"""The fast state read and the staging plan of async saves: they must give
exactly what `get_state_dict` and a fresh staging would, or step aside."""

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

import kuangchao.workers.checkpoint.async_save as async_mod
import kuangchao.workers.checkpoint.state_reader as state_mod
from kuangchao.workers.checkpoint.async_save import StagingBuffers, stage_to_cpu
from kuangchao.workers.checkpoint.manager import CheckpointManager
from kuangchao.workers.checkpoint.state_reader import StateDictReader
from kuangchao.workers.models.factory import build_model

from .test_checkpoint_async import CFG, _staged_ptrs, make, snapshot, step

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def mgr(tmp_path):
    return CheckpointManager(tmp_path, "job-1", rank=0, world_size=1, spec_hash="abc", keep_last=3)


def _assert_same(a, b, path=()):
    """Equal nested states: same keys in the same order, equal tensors, equal plain values."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _assert_same(a[k], b[k], (*path, k))
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, (*path, i))
    else:
        assert a == b, (path, a, b)


def _count_full_reads(monkeypatch):
    """A list that gets one entry per call of the real get_state_dict by the reader."""
    calls = []
    real = state_mod.get_state_dict

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(state_mod, "get_state_dict", counting)
    return calls


def test_the_reader_returns_what_get_state_dict_does_as_training_goes_on(monkeypatch):
    model, opt = make()
    calls = _count_full_reads(monkeypatch)
    read = StateDictReader()
    _assert_same(read(model, opt), get_state_dict(model, opt))
    assert len(calls) == 1  # learned from the full call
    staged = None
    for lr in (0.5, 0.25, 0.125):
        step(model, opt)
        opt.param_groups[0]["lr"] = lr
        opt.param_groups[0]["betas"] = (0.8, 0.9)
        model_sd, optim_sd = read(model, opt)
        assert len(calls) == 1  # the fast path
        assert optim_sd["param_groups"][0]["lr"] == lr
        _assert_same((model_sd, optim_sd), get_state_dict(model, opt))
        # Staged through the previous copy's buffers, as save_async does: as a fresh copy of a fresh read.
        staged = stage_to_cpu({"model": model_sd, "optim": optim_sd}, into=staged)
        fresh_m, fresh_o = get_state_dict(model, opt)
        _assert_same(staged, stage_to_cpu({"model": fresh_m, "optim": fresh_o}))


def test_the_reader_falls_back_to_get_state_dict_when_the_model_or_optimizer_changes(monkeypatch):
    model, opt = make()
    calls = _count_full_reads(monkeypatch)
    read = StateDictReader()
    read(model, opt)
    read(model, opt)
    assert len(calls) == 1
    # A parameter replaced under the same name, and in the optimizer too.
    old = model.norm.weight
    new = model.norm.weight = torch.nn.Parameter(old.detach().clone())
    with pytest.raises(KeyError):  # the optimizer's parameter is not the model's: as get_state_dict
        get_state_dict(model, opt)
    with pytest.raises(KeyError):
        read(model, opt)
    opt.param_groups[0]["params"] = [new if p is old else p for p in opt.param_groups[0]["params"]]
    opt.state[new] = opt.state.pop(old)
    _assert_same(read(model, opt), get_state_dict(model, opt))
    assert len(calls) == 3
    # A new parameter group, then a buffer added to the model.
    extra = torch.nn.Parameter(torch.ones(3))
    model.extra = extra
    opt.add_param_group({"params": [extra], "lr": 0.3})
    step(model, opt)  # "extra" has no grad: it gets no state, as with get_state_dict
    _assert_same(read(model, opt), get_state_dict(model, opt))
    model.register_buffer("counter", torch.zeros(2))
    _assert_same(read(model, opt), get_state_dict(model, opt))
    n = len(calls)
    _assert_same(read(model, opt), get_state_dict(model, opt))
    assert len(calls) == n  # relearned: fast again
    # Another model and optimizer.
    other, other_opt = make(seed=3)
    _assert_same(read(other, other_opt), get_state_dict(other, other_opt))
    assert len(calls) == n + 1


def test_the_reader_leaves_an_optimizer_without_state_to_get_state_dict(monkeypatch):
    torch.manual_seed(0)
    model = build_model(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    calls = _count_full_reads(monkeypatch)
    read = StateDictReader()
    model_sd, optim_sd = read(model, opt)
    assert len(calls) == 1 and optim_sd["state"]  # get_state_dict initialized the state
    _assert_same((model_sd, optim_sd), get_state_dict(model, opt))
    read(model, opt)
    assert len(calls) == 1


def test_the_reader_gives_up_for_good_on_a_pair_it_cannot_reproduce(monkeypatch):
    model, opt = make()
    calls = _count_full_reads(monkeypatch)
    monkeypatch.setattr(state_mod, "_same_state", lambda a, b: False)
    read = StateDictReader()
    learned = []
    real_learn = StateDictReader._learn

    def learn(self, *args):
        learned.append(self._never)
        return real_learn(self, *args)

    monkeypatch.setattr(StateDictReader, "_learn", learn)
    for _ in range(3):
        _assert_same(read(model, opt), get_state_dict(model, opt))
    assert len(calls) == 3 and learned == [False, True, True]  # tried once, then not again


def test_a_checkpoint_saved_through_the_fast_read_loads_back_the_same(mgr, monkeypatch):
    model, opt = make()
    calls = _count_full_reads(monkeypatch)
    mgr.save_async(1, model, opt, rank_state={"step": 1}).result()
    for _ in range(2):
        step(model, opt)
    opt.param_groups[0]["lr"] = 0.05
    weights, opt_state = snapshot(model, opt)
    pending = mgr.save_async(3, model, opt, rank_state={"step": 3})
    assert len(calls) == 1  # the second save read the state the fast way
    step(model, opt)  # training goes on while it is written
    opt.param_groups[0]["lr"] = 0.01
    pending.result()
    fresh, fresh_opt = make(seed=7)
    assert mgr.load(pending.path, fresh, fresh_opt) == {"step": 3}
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, weights[k]), k
    assert len(fresh_opt.state) == len(opt_state)
    for i, s in enumerate(fresh_opt.state.values()):
        assert list(s) == list(opt_state[i])
        for k, v in s.items():
            assert torch.equal(v, opt_state[i][k]), (i, k)
    saved_groups = [{k: v for k, v in g.items() if k != "params"} for g in fresh_opt.param_groups]
    assert saved_groups[0]["lr"] == 0.05
    assert saved_groups == [{**{k: v for k, v in g.items() if k != "params"}, "lr": 0.05}
                            for g in opt.param_groups]


# -- staging along the last copy's plan ----------------------------------------

def _state(tied=True):
    emb = torch.randn(4, 3)
    return {"model": {"emb": emb, "head": emb if tied else emb.clone(), "b": torch.zeros(3)},
            "optim": {"state": {"emb": {"exp_avg": torch.ones(4, 3), "step": torch.tensor(1.0)}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["emb", "b"],
                                        "note": None}]}}


def test_restaging_a_state_laid_out_as_before_copies_into_the_same_buffers(monkeypatch):
    state = _state()
    buffers = StagingBuffers()
    first = buffers.stage(state)
    assert buffers._plan is not None
    ptrs = _staged_ptrs(first)
    restaged = []
    real = async_mod._Plan.restage

    def restage(self, obj):
        restaged.append(real(self, obj))
        return restaged[-1]

    monkeypatch.setattr(async_mod._Plan, "restage", restage)
    # Training: everything in place, plain values replaced.
    state["model"]["emb"].add_(1.0)
    state["model"]["b"].fill_(2.0)
    state["optim"]["state"]["emb"]["step"].add_(1)
    group = state["optim"]["param_groups"][0]
    group["lr"], group["betas"] = 0.05, (0.8, 0.9)
    second = buffers.stage(state)
    assert restaged[-1] is second and buffers.state is second
    assert _staged_ptrs(second) == ptrs  # the same memory
    assert second["model"]["head"] is second["model"]["emb"]  # still one copy for the tied pair
    _assert_same(second, stage_to_cpu(state))  # what a fresh copy would be
    assert second["optim"]["param_groups"][0] is not group
    assert second["optim"]["param_groups"][0]["params"] is not group["params"]
    for k, v in state["model"].items():
        assert second["model"][k].data_ptr() != v.data_ptr(), k
    state["model"]["emb"].add_(1.0)  # the copy is a copy
    assert not torch.equal(second["model"]["emb"], state["model"]["emb"])


@pytest.mark.parametrize("change", ["untie", "new key", "shape", "dtype", "tensor to value",
                                    "value to tensor", "list length", "storage swapped"])
def test_a_state_laid_out_otherwise_is_staged_as_stage_to_cpu_does(change):
    state = _state()
    buffers = StagingBuffers()
    first = buffers.stage(state)
    ptrs = _staged_ptrs(first)
    model, group = state["model"], state["optim"]["param_groups"][0]
    if change == "untie":
        model["head"] = model["emb"].clone()
    elif change == "new key":
        model["c"] = torch.ones(2)
    elif change == "shape":
        model["b"] = torch.zeros(4)
    elif change == "dtype":
        model["b"] = torch.zeros(3, dtype=torch.float64)
    elif change == "tensor to value":
        state["optim"]["state"]["emb"]["step"] = 2
    elif change == "value to tensor":
        group["lr"] = torch.tensor(0.1)
    elif change == "list length":
        group["params"].append("head")
    else:  # same shapes and dtypes, other memory: training swapped a tensor
        model["b"] = torch.zeros(3)
    expected = stage_to_cpu(state, into=stage_to_cpu(_state()))  # the general walk's choices
    second = buffers.stage(state)
    _assert_same(second, stage_to_cpu(state))
    assert _staged_ptrs(second).keys() == _staged_ptrs(expected).keys()
    # Reused where the general walk reuses: same place, shape and dtype.
    assert second["model"]["emb"].data_ptr() == ptrs[("model", "emb")]
    if change == "untie":
        assert second["model"]["head"].data_ptr() != second["model"]["emb"].data_ptr()
    if change in ("shape", "dtype"):
        assert second["model"]["b"].data_ptr() != ptrs[("model", "b")]
    third = buffers.stage(state)  # and the new layout's plan takes the next save
    assert _staged_ptrs(third) == _staged_ptrs(second)
    _assert_same(third, stage_to_cpu(state))


def test_tensor_subclasses_get_no_plan():
    class Marked(torch.Tensor):
        pass

    state = {"w": torch.ones(3).as_subclass(Marked), "v": torch.ones(2)}
    buffers = StagingBuffers()
    staged = buffers.stage(state)
    assert buffers._plan is None and torch.equal(staged["w"], state["w"])
    buffers.drop()
    assert buffers.state is None
