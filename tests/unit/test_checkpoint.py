"""Checkpoints in one process: commit, verify, skip a corrupt one, reload."""

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystem

import kuangchao.workers.checkpoint.files as ckpt_io
import kuangchao.workers.checkpoint.writer as ckpt_writer
from kuangchao.platform.protocol.checkpoint import CHECKSUM, checksum_file, verify
from kuangchao.workers.checkpoint.manager import CheckpointManager, load_model_state
from kuangchao.workers.errors import CheckpointError
from kuangchao.workers.models.factory import ModelConfig, build_model

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


def flip_a_bit(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_digests_taken_while_writing_match_the_files_on_disk(mgr):
    model, opt = make()
    info = mgr.save(1, model, opt, rank_state={"step": 1})
    manifest = verify(info.path)
    assert manifest["checksum"] == CHECKSUM == "crc32"
    folder = Path(info.path)
    on_disk = sorted(p.name for p in folder.iterdir() if p.name != "manifest.json")
    assert sorted(manifest["files"]) == on_disk
    for name, entry in manifest["files"].items():
        assert entry == {"bytes": (folder / name).stat().st_size,
                         "crc32": checksum_file(folder / name, "crc32")}, name
    # the writer threads' zip CRC switch never leaks into the caller's torch.save
    assert torch.serialization.get_crc32_options()


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("which", ["distcp", "rank_0.pt"])
def test_verify_catches_one_flipped_bit_in_a_shard_or_rank_file(mgr, which):
    model, opt = make()
    info = mgr.save(1, model, opt, rank_state={"step": 1})
    folder = Path(info.path)
    shards = sorted(p for p in folder.iterdir() if p.suffix == ".distcp")
    f = shards[0] if which == "distcp" else folder / which
    flip_a_bit(f, f.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=f"{f.name} fails its checksum"):
        verify(info.path)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_verify_refuses_an_unknown_checksum(mgr):
    model, opt = make()
    info = mgr.save(1, model, opt, rank_state={})
    path = Path(info.path) / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "checksum": "md4"}))
    with pytest.raises(CheckpointError, match="checksum 'md4'"):
        verify(info.path)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_pruned_checkpoints_leave_the_listing_at_once_and_the_disk_in_the_background(mgr):
    model, opt = make()
    for step in (1, 2, 3, 4):
        mgr.save(step, model, opt, rank_state={})
        assert len(mgr.list()) == min(step, 2)  # retired at the commit, not later
    assert mgr.wait_pruned(timeout=30)
    assert sorted(p.name for p in mgr.dir.iterdir()) == ["step_00000003", "step_00000004"]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_prune_keeps_what_was_just_committed_and_what_is_being_read(tmp_path):
    mgr = CheckpointManager(tmp_path, "job-1", rank=0, world_size=1, spec_hash="abc", keep_last=1)
    model, opt = make()
    mgr.save(20, model, opt, rank_state={})
    # Resumed from an older step: the new commit sorts before step 20 and must stay.
    info = mgr.save(15, model, opt, rank_state={})
    assert [p.name for p in mgr.list()] == ["step_00000015", "step_00000020"]
    assert verify(info.path)["step"] == 15
    with mgr._reading_from(Path(info.path)):  # as load() and latest_verified() do
        mgr.save(30, model, opt, rank_state={})
        assert [p.name for p in mgr.list()] == ["step_00000015", "step_00000030"]
    mgr.save(31, model, opt, rank_state={})
    assert [p.name for p in mgr.list()] == ["step_00000031"]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_rerun_of_a_step_replaces_the_committed_copy(mgr):
    model, opt = make(0)
    first = mgr.save(1, model, opt, rank_state={"run": 1})
    other = CheckpointManager(mgr.dir.parent, "job-1", rank=0, world_size=1, spec_hash="abc", keep_last=2)
    fresh, fresh_opt = make(5)
    second = other.save(1, fresh, fresh_opt, rank_state={"run": 2})
    assert first.path == second.path and [p.name for p in mgr.list()] == ["step_00000001"]
    assert other.wait_pruned(timeout=30)
    assert [p.name for p in mgr.dir.iterdir()] == ["step_00000001"]
    assert mgr.load(mgr.latest_verified()[0], *make(6)) == {"run": 2}


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_files_the_writer_did_not_checksum_are_read_back(mgr, monkeypatch):
    # As with a DCP version that writes some file without going through `create_stream`.
    monkeypatch.setattr(ckpt_io.ChecksummingFileSystem, "create_stream", FileSystem.create_stream)
    model, opt = make()
    info = mgr.save(1, model, opt, rank_state={})
    manifest = verify(info.path)
    assert any(name.endswith(".distcp") for name in manifest["files"])
    for name, entry in manifest["files"].items():
        assert entry["crc32"] == checksum_file(Path(info.path) / name, "crc32"), name


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_manifest_names_the_checksum_it_was_written_with(mgr, monkeypatch):
    monkeypatch.setattr(ckpt_writer, "CHECKSUM", "sha256")
    monkeypatch.setattr(ckpt_io, "CHECKSUM", "sha256")
    model, opt = make()
    info = mgr.save(1, model, opt, rank_state={})
    manifest = verify(info.path)
    assert manifest["checksum"] == "sha256"
    assert all(set(e) == {"bytes", "sha256"} for e in manifest["files"].values())


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_rank_state_with_rng_states_loads_and_a_crafted_one_runs_nothing(mgr, tmp_path):
    from kuangchao.workers.trainer.resume import rng_state

    model, opt = make(0)
    info = mgr.save(3, model, opt, rank_state={"rng": rng_state(), "step": 3})
    state = mgr.load(info.path, *make(1))
    assert state["step"] == 3 and state["rng"]["numpy"][1].dtype.name == "uint32"

    # A rank file that names a callable to run on unpickling (what job code could write).
    import pickle

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))
    crafted = tmp_path / "rank_0.pt"
    torch.save({"step": 1, "x": Payload()}, crafted, pickle_module=pickle)
    with pytest.raises(CheckpointError, match="not a rank state this platform reads"):
        ckpt_io.load_rank_state(crafted)
    assert not marker.exists()
