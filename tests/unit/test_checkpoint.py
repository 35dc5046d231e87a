"""Checkpoints in one process: commit, verify, skip a corrupt one, reload."""

import json

import pytest
import torch

from kuangchao.workers.checkpoint import CheckpointManager, load_model_state, verify
from kuangchao.workers.errors import CheckpointError
from kuangchao.workers.model import ModelConfig, build_model

CFG = ModelConfig(type="gpt", n_layers=1, n_heads=2, d_model=16, seq_len=8, vocab_size=32)


def make(seed=0):
    torch.manual_seed(seed)
    model = build_model(CFG)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


@pytest.fixture
def mgr(tmp_path):
    return CheckpointManager(tmp_path, "job-1", rank=0, world_size=1, spec_hash="abc", keep_last=2)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_checkpoint_round_trips_weights_and_rank_state(mgr):
    model, opt = make(0)
    info = mgr.save(5, model, opt, rank_state={"step": 5})
    manifest = verify(info.path)
    assert manifest["step"] == 5 and manifest["spec_hash"] == "abc" and info.bytes > 0
    other, other_opt = make(1)
    assert not torch.equal(other.lm_head.weight, model.lm_head.weight)
    assert mgr.load(mgr.latest_verified()[0], other, other_opt) == {"step": 5}
    for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_checkpoint_keeps_only_the_last_k(mgr):
    model, opt = make()
    for step in (1, 2, 3):
        mgr.save(step, model, opt, rank_state={})
    assert [p.name for p in mgr.list()] == ["step_00000002", "step_00000003"]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_latest_verified_skips_a_truncated_checkpoint(mgr):
    model, opt = make()
    mgr.save(1, model, opt, rank_state={})
    newest = mgr.save(2, model, opt, rank_state={})
    shard = next(p for p in sorted(mgr.list()[-1].iterdir()) if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(CheckpointError, match="bytes, the manifest says"):
        verify(newest.path)
    path, manifest = mgr.latest_verified()
    assert manifest["step"] == 1 and path.name == "step_00000001"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_verify_reports_missing_manifest_and_bitflip(mgr, tmp_path):
    with pytest.raises(CheckpointError, match="partial"):
        verify(tmp_path)
    model, opt = make()
    info = mgr.save(1, model, opt, rank_state={})
    manifest = json.loads((mgr.list()[0] / "manifest.json").read_text())
    name = next(iter(manifest["files"]))
    f = mgr.list()[0] / name
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        verify(info.path)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_load_model_state_loads_weights_in_a_plain_process(mgr):
    model, opt = make(3)
    info = mgr.save(9, model, opt, rank_state={})
    fresh, _ = make(4)
    assert load_model_state(info.path, fresh)["step"] == 9
    assert torch.equal(fresh.tok_emb.weight, model.tok_emb.weight)
