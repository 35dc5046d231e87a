"""Checkpoint and profile files written by a job's code, read by trusted processes
(issue 22): the DCP metadata unpickled with a restricted unpickler, no symlink
followed out of the job's folder (the CLI, the API server, the controller, the
rank's prefix check), and the worker's own check of the checkpoint roots."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from kuangchao.platform.protocol.checkpoint import MANIFEST, checksum_file
from kuangchao.platform.security.tokens import Minter, Scope, generate_key, public_pem
from kuangchao.workers.checkpoint import dcp_reader
from kuangchao.workers.checkpoint.export import _load, read_model_tensors
from kuangchao.workers.checkpoint.manager import CheckpointManager
from kuangchao.workers.checkpoint.paths import check_step_folder, leads_inside
from kuangchao.workers.errors import CheckpointError
from kuangchao.workers.runtime.credentials import GuardedCheckpoints, TokenHolder
from tests.checkpoint_folders import checkpoint_cli, job_with_two_checkpoints

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def kc(*args: str):
    return checkpoint_cli(*args)


@pytest.fixture
def job(tmp_path):
    return job_with_two_checkpoints(tmp_path)


def rewrite(step: Path, name: str, data: bytes) -> None:
    """Replace one file of a checkpoint and its manifest entry, as the job's code could."""
    (step / name).write_bytes(data)
    manifest = json.loads((step / MANIFEST).read_text())
    algorithm = manifest.get("checksum", "sha256")
    manifest["files"][name] = {"bytes": len(data), algorithm: checksum_file(step / name, algorithm)}
    (step / MANIFEST).write_text(json.dumps(manifest))


def real_metadata(step: Path):
    with open(step / ".metadata", "rb") as fh:
        return pickle.load(fh)  # the test's own checkpoint: the full unpickler is fine here


class RunsCode:
    """Unpickled, it runs a shell command (writes a marker file)."""

    def __init__(self, marker: Path, via: tuple[object, str] | None = None) -> None:
        self.marker, self.via = marker, via

    def __reduce__(self):
        if self.via is not None:
            return self.via[0], (self.via[1],)
        return os.system, (f"touch {self.marker}",)


# -- the DCP metadata --------------------------------------------------------------

def test_a_real_save_unpickles_with_only_the_allowed_globals(job):
    folder, _ = job
    seen: set[tuple[str, str]] = set()

    class Tracing(dcp_reader.MetadataUnpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    for step in sorted(folder.glob("step_*")):
        with open(step / ".metadata", "rb") as fh:
            got = Tracing(fh, str(step)).load()
        assert got == real_metadata(step)
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in seen
    assert all(k in dcp_reader._GLOBALS or k[0] == "torch" for k in seen), seen


@pytest.mark.parametrize("via", [None, "eval", "torch.load", "os.popen"])
def test_export_refuses_metadata_that_would_run_code_and_runs_none(job, tmp_path, via):
    folder, _ = job
    step = folder / "step_00000002"
    marker = tmp_path / "pwned"
    payload = {None: None, "eval": (eval, f"open({str(marker)!r}, 'w')"),
               "torch.load": (torch.load, str(marker)),
               "os.popen": (os.popen, f"touch {marker}")}[via]
    metadata = real_metadata(step)
    metadata.planner_data = {"x": RunsCode(marker, payload)}
    rewrite(step, ".metadata", pickle.dumps(metadata))
    out = kc("export", str(folder), "--out", str(tmp_path / "m.safetensors"))
    assert out.exit_code == 2, out.stderr
    assert "refusing to unpickle" in out.stderr and "Traceback" not in out.stderr
    assert not marker.exists()
    assert not (tmp_path / "m.safetensors").exists()


def test_metadata_that_is_not_dcp_metadata_is_refused(job):
    folder, _ = job
    step = folder / "step_00000002"
    (step / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(CheckpointError, match="not DCP metadata"):
        read_model_tensors(step)
    (step / ".metadata").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(CheckpointError, match="cannot read the DCP metadata"):
        read_model_tensors(step)
    # Allowed classes only, but not built as DCP builds them.
    from torch.distributed.checkpoint.metadata import Metadata
    (step / ".metadata").write_bytes(pickle.dumps(Metadata.__new__(Metadata)))
    with pytest.raises(CheckpointError, match="malformed DCP metadata"):
        read_model_tensors(step)


def test_a_shard_named_outside_the_folder_is_refused(job):
    folder, _ = job
    step = folder / "step_00000002"
    metadata = real_metadata(step)
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = f"../step_00000001/{info.relative_path}"
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="not a file of the checkpoint folder"):
        read_model_tensors(step)


def test_a_tensor_larger_than_its_shards_is_refused_before_allocating(job):
    folder, _ = job
    step = folder / "step_00000002"
    metadata = real_metadata(step)
    metadata.state_dict_metadata["model.tok_emb.weight"].size = torch.Size([1 << 20, 1 << 20])
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="larger in the DCP metadata than in its shards"):
        read_model_tensors(step)


def test_a_pickled_item_is_refused_not_unpickled(job):
    folder, _ = job
    step = folder / "step_00000002"
    with dcp_reader.FolderReader(step) as reader, \
            pytest.raises(CheckpointError, match="stored pickled"):
        _load({"optim.param_groups.0.lr": 0.0}, reader, step)


def test_a_real_checkpoint_still_exports_its_weights(job):
    folder, model = job
    tensors = read_model_tensors(folder / "step_00000002")
    assert tensors.keys() == model.state_dict().keys()
    assert all(torch.equal(tensors[k], v) for k, v in model.state_dict().items())


# -- symlinks in what kc checkpoint reads ---------------------------------------------

def test_a_shard_swapped_for_a_symlink_is_not_read(job, tmp_path):
    folder, _ = job
    step = folder / "step_00000002"
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 100_000)
    shard = next(p for p in sorted(step.iterdir()) if p.suffix == ".distcp")
    shard.unlink()
    shard.symlink_to(secret)
    with pytest.raises(CheckpointError, match="is a symlink"):
        check_step_folder(step, str(folder))
    with pytest.raises(CheckpointError, match="a symlink, which no checkpoint holds"):
        read_model_tensors(step)  # the reader itself opens nothing through one either
    out = kc("export", str(folder), "--out", str(tmp_path / "m.pt"), "--format", "torch")
    assert out.exit_code == 2 and "is a symlink" in out.stderr


def test_a_step_folder_leading_to_another_jobs_is_refused(job, tmp_path):
    folder, _ = job
    other = job_with_two_checkpoints(tmp_path / "other")[0]
    (folder / "step_00000003").symlink_to(other / "step_00000002")
    rows = json.loads(kc("list", str(folder), "--json").stdout)
    assert [(r["step"], r["verified"]) for r in rows] == [(1, True), (2, True), (3, False)]
    assert "leads outside" in rows[2]["reason"]
    for command in (["verify", str(folder)], ["export", str(folder), "--out", str(tmp_path / "m.pt")]):
        out = kc(*command)
        assert out.exit_code == 2 and "leads outside" in out.stderr, out.stderr


def test_a_job_folder_that_is_a_symlink_is_refused(job, tmp_path, monkeypatch):
    folder, _ = job
    other = job_with_two_checkpoints(tmp_path / "other")[0]
    planted = folder.parent / "job-9"
    planted.symlink_to(other)
    out = kc("list", str(planted))
    assert out.exit_code == 2 and "is a symlink" in out.stderr

    from kuangchao.platform.jobs.state import JobRecord
    from kuangchao.platform.jobs.store import JobStore

    class Store:
        def get(self, job_id):
            return JobRecord(id=job_id, name="j", spec={"checkpoint": {"path": str(folder.parent)}})

    monkeypatch.setattr(JobStore, "from_url", classmethod(lambda cls, url, prefix="kc:": Store()))
    out = kc("verify", "job-9")
    assert out.exit_code == 2 and "is a symlink" in out.stderr
    assert kc("verify", "job-1").exit_code == 0


def test_a_manifest_naming_a_file_outside_the_folder_is_refused(job):
    folder, _ = job
    step = folder / "step_00000002"
    manifest = json.loads((step / MANIFEST).read_text())
    manifest["files"]["../../../etc/passwd"] = {"bytes": 1, "crc32": "0"}
    (step / MANIFEST).write_text(json.dumps(manifest))
    out = kc("verify", str(step))
    assert out.exit_code == 2 and "not a file of the checkpoint folder" in out.stderr


def test_verify_itself_reads_no_symlink_and_no_name_outside_the_folder(job, tmp_path):
    """What a rank's resume verifies: the manifest's names and the files they lead to."""
    from kuangchao.platform.protocol.checkpoint import verify

    folder, _ = job
    step = folder / "step_00000002"
    verify(step)  # the real one verifies
    shard = next(p for p in sorted(step.iterdir()) if p.suffix == ".distcp")
    data = shard.read_bytes()
    (tmp_path / "elsewhere").write_bytes(data)
    shard.unlink()
    shard.symlink_to(tmp_path / "elsewhere")  # same bytes, same digest: only the link is wrong
    with pytest.raises(CheckpointError, match="is a symlink"):
        verify(step)
    shard.unlink()
    shard.write_bytes(data)
    manifest = json.loads((step / MANIFEST).read_text())
    manifest["files"]["../step_00000001/.metadata"] = {"bytes": 1, "sha256": "0"}
    (step / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="not a file name of the folder"):
        verify(step)


# -- the rank's prefix check ------------------------------------------------------------

@pytest.fixture
def holder(tmp_path):
    key = generate_key()
    scope = Scope(devices=(0,), groups=("world",), checkpoint_prefix=str(tmp_path / "ckpt" / "job-1"))
    token, _ = Minter(key).mint("job-1/rank-0", "job-1", "trainer", scope,
                                {"checkpoint_read", "checkpoint_write"}, 600)
    denied: list[tuple[str, str, str]] = []
    h = TokenHolder(token, public_pem(key), lambda _: False, lambda t: t, lambda *a: denied.append(a))
    h.denied = denied
    try:
        yield h
    finally:
        h.stop()


def test_a_symlink_inside_the_prefix_to_another_jobs_folder_is_refused(holder, tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = CheckpointManager(tmp_path / "ckpt", "job-2", 0, 1, "hash")
    theirs = Path(other.save(1, model, opt, rank_state={}).path)
    ckpt = GuardedCheckpoints(tmp_path / "ckpt", "job-1", 0, 1, "hash", holder=holder)
    ckpt.save(1, model, opt, rank_state={})
    planted = tmp_path / "ckpt" / "job-1" / "step_00000009"
    planted.symlink_to(theirs)
    with pytest.raises(PermissionError, match="through a symlink"):
        ckpt.load(planted, model, opt)
    dangling = tmp_path / "ckpt" / "job-1" / "later"  # leads to a folder not there yet
    dangling.symlink_to(tmp_path / "ckpt" / "job-2" / "not-yet")
    with pytest.raises(PermissionError, match="through a symlink"):
        holder.check_path("checkpoint_write", dangling / "step_00000001")
    assert [i for i, _, _ in holder.denied] == ["checkpoint_read", "checkpoint_write"]


def test_a_prefix_that_is_itself_a_symlink_is_refused(holder, tmp_path):
    (tmp_path / "ckpt" / "job-2").mkdir(parents=True)
    (tmp_path / "ckpt" / "job-1").symlink_to(tmp_path / "ckpt" / "job-2")
    with pytest.raises(PermissionError, match="through a symlink"):
        GuardedCheckpoints(tmp_path / "ckpt", "job-1", 0, 1, "hash", holder=holder)


def test_a_checkpoint_root_reached_through_symlinks_still_works(tmp_path):
    # Symlinks above the job's folder (an operator's /ckpt -> /mnt/disk) are fine.
    key = generate_key()
    (tmp_path / "disk").mkdir()
    (tmp_path / "ckpt").symlink_to(tmp_path / "disk")
    scope = Scope(checkpoint_prefix=str(tmp_path / "ckpt" / "job-1"))
    token, _ = Minter(key).mint("job-1/rank-0", "job-1", "trainer", scope,
                                {"checkpoint_read", "checkpoint_write"}, 600)
    h = TokenHolder(token, public_pem(key), lambda _: False, lambda t: t, lambda *a: None)
    try:
        ckpt = GuardedCheckpoints(tmp_path / "ckpt", "job-1", 0, 1, "hash", holder=h)
        model = torch.nn.Linear(2, 2)
        info = ckpt.save(1, model, torch.optim.SGD(model.parameters(), lr=0.1), rank_state={})
        assert (tmp_path / "disk" / "job-1" / "step_00000001").is_dir() and info.step == 1
    finally:
        h.stop()


# -- the controller's final checkpoint ----------------------------------------------------

def test_the_controller_refuses_a_final_checkpoint_through_a_symlink(tmp_path):
    from kuangchao.platform.errors import KuangchaoError
    from kuangchao.platform.execution.grants import Credentials

    mine = job_with_two_checkpoints(tmp_path)[0]  # tmp/ckpt/job-1
    theirs = job_with_two_checkpoints(tmp_path / "other")[0]
    _, claims = Minter(generate_key()).mint("job-1/controller", "job-1", "controller",
                                            Scope(checkpoint_prefix=str(mine)),
                                            {"checkpoint_read"}, 600)
    ctl = Credentials("job-1")
    ctl.own_claims = claims
    assert ctl.within_job(mine / "step_00000002") == mine / "step_00000002"
    (mine / "step_00000003").symlink_to(theirs / "step_00000002")
    with pytest.raises(KuangchaoError, match="through a symlink"):
        ctl.within_job(mine / "step_00000003")
    (mine / "step_00000002" / "rank_0.pt").unlink()
    (mine / "step_00000002" / "rank_0.pt").symlink_to(theirs / "step_00000002" / "rank_0.pt")
    with pytest.raises(CheckpointError, match="is a symlink"):
        ctl.within_job(mine / "step_00000002")


# -- the worker's check of the checkpoint roots -------------------------------------------

def test_the_worker_refuses_a_checkpoint_folder_leading_outside_the_roots(tmp_path):
    root = tmp_path / "kc"
    (root / "ok").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "there").symlink_to(tmp_path / "outside")
    (root / "nowhere").symlink_to(tmp_path / "not-there")
    roots = (str(root),)
    messages = []
    for name in ("there", "nowhere"):
        with pytest.raises(CheckpointError, match="KC_CHECKPOINT_ROOTS") as exc:
            CheckpointManager(root / name, "job-1", 0, 1, "h", roots=roots)
        messages.append(exc.value.message.replace(name, "X"))
    # Whether anything exists where the symlink leads is not said, nor where it leads.
    assert messages[0] == messages[1]
    assert "not-there" not in messages[1] and str(tmp_path / "outside") not in messages[0]
    mgr = CheckpointManager(root / "ok", "job-1", 0, 1, "h", roots=roots)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr.save(1, model, opt, rank_state={})
    # A symlink planted after the start: the next save and load are refused.
    (root / "ok" / "job-1").rename(root / "moved")
    (root / "ok" / "job-1").symlink_to(tmp_path / "outside")
    with pytest.raises(CheckpointError, match="KC_CHECKPOINT_ROOTS"):
        mgr.save(2, model, opt, rank_state={})
    with pytest.raises(CheckpointError, match="KC_CHECKPOINT_ROOTS"):
        mgr.latest_verified()


def test_leads_inside_resolves_what_does_not_exist_yet(tmp_path):
    (tmp_path / "job").mkdir()
    assert leads_inside(tmp_path / "job" / "a" / "b", str(tmp_path / "job"))
    assert not leads_inside(tmp_path / "job" / ".." / "x", str(tmp_path / "job"))
    (tmp_path / "job" / "link").symlink_to(tmp_path)
    assert not leads_inside(tmp_path / "job" / "link" / "new", str(tmp_path / "job"))


# -- the API server's profile downloads ------------------------------------------------------

@pytest.fixture
def api(monkeypatch, tmp_path):
    from fastapi.testclient import TestClient

    from kuangchao.api.server.app import create_app
    from kuangchao.api.server.dependencies import auth
    from kuangchao.api.server.dependencies import store as deps
    from kuangchao.platform.jobs.memory import MemoryStore
    from kuangchao.platform.jobs.state import JobRecord, JobState
    from kuangchao.platform.security.keystore import KeyStore

    store = MemoryStore()
    monkeypatch.setenv("KC_HOME", str(tmp_path))
    monkeypatch.delenv("KC_CHECKPOINT_ROOTS", raising=False)
    monkeypatch.setattr(deps, "open_store", lambda: store)
    auth._trail.cache_clear()
    key, _ = KeyStore(store).create("alice", "team-a", "submitter")
    client = TestClient(create_app())
    client.headers["Authorization"] = f"Bearer {key}"
    spec = {"task": {"name": "p"}, "model": {"n_layers": 1, "n_heads": 2, "d_model": 32, "seq_len": 32},
            "parallel": {"data_parallel_size": 1}, "training": {"steps": 5},
            "checkpoint": {"path": str(tmp_path / "ckpt")}}
    store.create(JobRecord(id="prof-00000001", name="p", spec=spec, state=JobState.RUNNING,
                           world_size=1, tenant="team-a"))
    profile = tmp_path / "ckpt" / "prof-00000001" / "profiles" / "0123456789ab"
    profile.mkdir(parents=True)
    yield client, profile
    auth._trail.cache_clear()


URL = "/v1/jobs/prof-00000001/profiles/0123456789ab/rank0.json.gz"


def test_the_api_serves_a_trace_in_the_jobs_folder(api):
    client, profile = api
    (profile / "rank0.json.gz").write_bytes(b"trace" * 1000)
    resp = client.get(URL)
    assert resp.status_code == 200 and resp.content == b"trace" * 1000
    assert resp.headers["content-type"] == "application/gzip"
    assert "prof-00000001-rank0.json.gz" in resp.headers["content-disposition"]
    assert client.get(URL.replace("rank0", "rank1")).status_code == 404


def test_the_api_serves_no_trace_through_a_symlink(api, tmp_path):
    client, profile = api
    secret = tmp_path / "credentials"
    secret.write_text("admin-key")
    (profile / "rank0.json.gz").symlink_to(secret)
    resp = client.get(URL)
    assert resp.status_code == 403 and "admin-key" not in resp.text
    (profile / "rank0.json.gz").unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "rank0.json.gz").write_text("not the job's")
    profiles = profile.parent
    (profiles / "0123456789ab").rename(profiles / "gone")
    (profiles / "0123456789ab").symlink_to(elsewhere)  # a folder on the way
    assert client.get(URL).status_code == 403


def test_the_api_serves_nothing_of_a_job_folder_that_is_a_symlink(api, tmp_path):
    client, profile = api
    job = profile.parent.parent
    job.rename(tmp_path / "real-job")
    (tmp_path / "real-job" / "profiles" / "0123456789ab" / "rank0.json.gz").write_text("x")
    job.symlink_to(tmp_path / "real-job")
    assert client.get(URL).status_code == 403


def test_a_trace_that_unpacks_past_the_cap_is_not_written(tmp_path, monkeypatch):
    """`kc profile` unpacks a job-written trace in bounded chunks, not whole in memory."""
    import gzip

    from kuangchao.api.cli import debug

    monkeypatch.setattr(debug, "MAX_TRACE_BYTES", 4 << 20)
    small, bomb = gzip.compress(b"{}" * 1000), gzip.compress(b"\0" * (8 << 20))
    assert len(bomb) < 64 << 10  # megabytes from kilobytes: what a crafted file does
    assert debug._write_trace(small, tmp_path / "rank0.json")
    assert (tmp_path / "rank0.json").read_bytes() == b"{}" * 1000
    assert not debug._write_trace(bomb, tmp_path / "rank1.json")
    assert not (tmp_path / "rank1.json").exists()
    assert not debug._write_trace(b"not gzip", tmp_path / "rank2.json")
