"""Async checkpoints: staged state, blocked time, errors, metadata, and a 2-rank gloo run."""

import json
import os
import time
from pathlib import Path

import pytest
import torch

import kuangchao.workers.checkpoint.manager as ckpt
from kuangchao.platform.protocol.checkpoint import sha256_file, verify
from kuangchao.platform.version import __version__
from kuangchao.workers.checkpoint.async_save import stage_to_cpu
from kuangchao.workers.checkpoint.manager import CheckpointManager, load_model_state
from kuangchao.workers.errors import CheckpointError
from kuangchao.workers.models.factory import ModelConfig, build_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CFG = ModelConfig(type="gpt", n_layers=1, n_heads=2, d_model=16, seq_len=8, vocab_size=32)
RNG_STATE = {"rng": {"torch": torch.get_rng_state(), "numpy": 1, "python": 2}, "step": 0}


def make(seed=0, cfg=CFG):
    torch.manual_seed(seed)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, opt)  # the optimizer has state (exp_avg, exp_avg_sq) to save
    return model, opt


def step(model, opt):
    x = torch.randint(0, 32, (2, 8))
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def snapshot(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())})


@pytest.fixture
def mgr(tmp_path):
    return CheckpointManager(tmp_path, "job-1", rank=0, world_size=1, spec_hash="abc", keep_last=3)


def test_async_save_holds_the_state_of_the_call_even_when_training_goes_on(mgr):
    model, opt = make()
    weights, opt_state = snapshot(model, opt)
    pending = mgr.save_async(1, model, opt, rank_state={"step": 1})
    with torch.no_grad():  # change everything in place before the write is done
        for p in model.parameters():
            p.add_(1.0)
    step(model, opt)
    info = pending.result()
    assert verify(info.path)["step"] == 1 and mgr.wait() == info and mgr.wait() is None
    fresh, fresh_opt = make(seed=7)
    assert mgr.load(mgr.latest_verified()[0], fresh, fresh_opt) == {"step": 1}
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, weights[k]), k
    for i, s in enumerate(fresh_opt.state.values()):
        for k, v in s.items():
            assert torch.equal(v, opt_state[i][k]), (i, k)


def _staged_ptrs(staged):
    """{path: data_ptr} of every tensor in a staged copy."""
    out = {}

    def walk(obj, path):
        if isinstance(obj, torch.Tensor):
            out[path] = obj.data_ptr()
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, (*path, k))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, (*path, i))

    walk(staged, ())
    return out


def test_consecutive_async_saves_reuse_the_staging_memory_and_write_the_second_state(mgr):
    model, opt = make()
    first_weights, _ = snapshot(model, opt)
    mgr.save_async(1, model, opt, rank_state={"step": 1}).result()
    before = _staged_ptrs(mgr._staging.state)
    assert len(before) > 10 and any(p[0] == "optim" for p in before)  # weights and Adam state
    step(model, opt)
    opt.param_groups[0]["lr"] = 0.5
    weights, opt_state = snapshot(model, opt)
    pending = mgr.save_async(2, model, opt, rank_state={"step": 2})
    assert _staged_ptrs(mgr._staging.state) == before  # copied into the same memory, nothing allocated
    with torch.no_grad():  # training goes on in place while step 2 is written
        for p in model.parameters():
            p.add_(1.0)
    opt.param_groups[0]["lr"] = 0.7  # plain values are copied, not shared
    step(model, opt)
    assert pending.result().step == 2
    fresh, fresh_opt = make(seed=7)
    assert mgr.load(pending.path, fresh, fresh_opt) == {"step": 2}
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, weights[k]), k
    for i, s in enumerate(fresh_opt.state.values()):
        for k, v in s.items():
            assert torch.equal(v, opt_state[i][k]), (i, k)
    assert fresh_opt.param_groups[0]["lr"] == 0.5
    first, _ = make(seed=7)  # step 1, written before the memory was reused, is still step 1's
    load_model_state(mgr.list()[0], first)
    for k, v in first.state_dict().items():
        assert torch.equal(v, first_weights[k]), k


def test_staging_reuses_only_tensors_of_the_same_shape_dtype_and_sharing():
    tied = torch.zeros(3)
    first = stage_to_cpu({"a": torch.ones(4), "b": torch.ones(2), "c": torch.ones(2, dtype=torch.int64),
                          "tied": [tied, tied], "n": 1})
    assert first["tied"][0] is first["tied"][1]
    state = {"a": torch.full((4,), 2.0), "b": torch.ones(5), "c": torch.ones(2),
             "tied": [torch.ones(3), torch.full((3,), 3.0)], "n": [2], "new": torch.ones(1)}
    ptrs = _staged_ptrs(first)
    second = stage_to_cpu(state, into=first)
    assert second["a"].data_ptr() == ptrs[("a",)]  # same shape and dtype: overwritten in place
    assert second["b"].data_ptr() != ptrs[("b",)] and second["b"].shape == (5,)
    assert second["c"].data_ptr() != ptrs[("c",)] and second["c"].dtype == torch.float32
    # Shared last time, two tensors now: one may take the old memory, the other must not.
    assert second["tied"][0].data_ptr() != second["tied"][1].data_ptr()
    assert second["tied"][0].data_ptr() == ptrs[("tied", 0)]
    assert second["n"] == [2] and second["n"] is not state["n"]
    for k in ("a", "b", "c", "new"):
        assert torch.equal(second[k], state[k]) and second[k].data_ptr() != state[k].data_ptr()
    assert torch.equal(second["tied"][1], state["tied"][1])


def test_blocked_time_is_below_the_write_time_for_a_model_of_megabytes(mgr):
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()  # ~8 MB of weights, ~16 MB of Adam state
    # Fastest of 3 against fastest of 3: on a busy 2-core machine another
    # process can stall any one copy (staging) past any one write. One torch
    # thread, as the trainer runs: a parallel copy waits for the busier core.
    blocked, written = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in (1, 2, 3):
            pending = mgr.save_async(step, model, opt, rank_state={})
            info = pending.result()
            assert info.bytes > 20e6
            assert info.blocked_s == pending.blocked_s
            blocked.append(info.blocked_s)
            written.append(info.write_s)
    finally:
        torch.set_num_threads(threads)
    assert min(blocked) < min(written), (blocked, written)


def test_a_background_failure_surfaces_on_the_next_wait_once(mgr, monkeypatch):
    model, opt = make()

    def broken_save(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(ckpt.dcp, "save", broken_save)
    pending = mgr.save_async(1, model, opt, rank_state={})
    with pytest.raises(CheckpointError, match="No space left on device"):
        mgr.wait()
    assert mgr._staging.state is None  # writer threads of the failed save may still read its copy
    with pytest.raises(CheckpointError, match="No space left"):
        pending.result()
    assert mgr.wait() is None  # raised once; the manager takes the next save
    assert mgr.list() == []  # nothing that looks committed was left behind
    monkeypatch.undo()
    assert verify(mgr.save_async(2, model, opt, rank_state={}).result().path)["step"] == 2


def test_a_background_failure_surfaces_on_the_next_save(mgr, monkeypatch):
    model, opt = make()
    monkeypatch.setattr(ckpt.dcp, "save", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    pending = mgr.save_async(1, model, opt, rank_state={})
    while not pending.done():  # the writer thread must meet the broken save before it is undone
        time.sleep(0.01)
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="step 1.*boom"):
        mgr.save(2, model, opt, rank_state={})
    assert mgr.save(2, model, opt, rank_state={}).step == 2


def test_only_one_save_is_in_flight_and_a_step_is_written_once(mgr):
    model, opt = make()
    first = mgr.save_async(1, model, opt, rank_state={})
    second = mgr.save_async(2, model, opt, rank_state={})
    assert first.done()  # the second call waited for the first
    info = mgr.save(2, model, opt, rank_state={})  # waits, and does not rewrite step 2
    assert second.done() and info == second.result()
    assert [p.name for p in mgr.list()] == ["step_00000001", "step_00000002"]


def test_on_commit_runs_on_rank_0_with_timings(tmp_path):
    seen = []
    mgr = CheckpointManager(tmp_path, "j", 0, 1, "h", on_commit=seen.append)
    model, opt = make()
    info = mgr.save_async(3, model, opt, rank_state={}).result()
    assert seen == [info]
    assert set(info.to_json()) == {"step", "path", "bytes", "blocked_s", "write_s"}


def test_manifest_records_versions_layout_data_position_and_rng(mgr):
    model, opt = make()
    layout = {"data_parallel_size": 1, "tensor_parallel_size": 1}
    info = mgr.save(4, model, opt, rank_state={**RNG_STATE, "step": 4},
                    extra={"parallel": layout, "data_position": {"step": 4, "skipped_batches": [3]},
                           "note": "kept"})
    m = verify(info.path)
    assert m["format"] == 3 and m["checksum"] == "crc32" and m["platform_version"] == __version__
    assert m["torch_version"] == torch.__version__ and m["spec_hash"] == "abc"
    assert m["world_size"] == 1 and m["step"] == 4 and m["parallel"] == layout
    assert m["data_position"] == {"step": 4, "skipped_batches": [3]} and m["note"] == "kept"
    assert m["rng"] == {"kinds": ["torch", "numpy", "python"], "rank_files": ["rank_0.pt"]}
    assert "rank_0.pt" in m["files"] and ".metadata" in m["files"]
    with pytest.raises(ValueError, match="files"):
        mgr.save(5, model, opt, rank_state={}, extra={"files": {}})


def test_verify_reads_format_1_and_refuses_an_unknown_format(mgr):
    model, opt = make()
    info = mgr.save(1, model, opt, rank_state={})
    path = os.path.join(info.path, "manifest.json")
    m = json.loads(open(path).read())
    old = {k: m[k] for k in ("step", "spec_hash", "world_size", "created_at")}
    # Formats 1 and 2 name no checksum: their digests are SHA-256.
    old["files"] = {name: {"bytes": e["bytes"], "sha256": sha256_file(Path(info.path) / name)}
                    for name, e in m["files"].items()}
    with open(path, "w") as f:
        json.dump({"format": 1, **old, "parallel": {}}, f)
    assert verify(info.path)["format"] == 1
    with open(path, "w") as f:
        json.dump({**m, "format": 99}, f)
    with pytest.raises(CheckpointError, match="format 99"):
        verify(info.path)


def test_a_stale_temporary_folder_is_removed_by_the_next_commit(mgr):
    model, opt = make()
    stale = mgr.dir / ".step_00000007.tmp"
    stale.mkdir(parents=True)
    (stale / "junk.distcp").write_bytes(b"x")
    mgr.save(8, model, opt, rank_state={})
    assert not stale.exists()
