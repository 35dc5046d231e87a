"""`kc checkpoint list|verify|export`: output, exported tensors, and exit codes."""

import json

import pytest
import torch
from safetensors.torch import load_file

from kuangchao.platform.errors import JobNotFound
from kuangchao.platform.jobs.state import JobRecord
from kuangchao.platform.jobs.store import JobStore
from tests.checkpoint_folders import checkpoint_cli, job_with_two_checkpoints, truncate_a_shard

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")



def kc(*args: str):
    return checkpoint_cli(*args)


@pytest.fixture
def job(tmp_path):
    return job_with_two_checkpoints(tmp_path)


def test_list_shows_every_checkpoint_and_why_one_does_not_verify(job):
    folder, _ = job
    truncate_a_shard(folder / "step_00000001")
    out = kc("list", str(folder))
    assert out.exit_code == 0
    lines = out.stdout.splitlines()
    assert "STEP" in lines[0] and "VERIFIED" in lines[0]
    assert " no " in lines[1] and "step_00000001" in lines[1]
    assert "not verified" in lines[2] and "the manifest says" in lines[2]
    assert " yes " in lines[3] and "step_00000002" in lines[3]
    rows = json.loads(kc("list", str(folder), "--json").stdout)
    assert [(r["step"], r["verified"]) for r in rows] == [(1, False), (2, True)]
    assert rows[1]["bytes"] > 0 and rows[1]["created_at"] > 0 and rows[1]["reason"] is None


def test_list_takes_one_step_folder(job):
    folder, _ = job
    rows = json.loads(kc("list", str(folder / "step_00000001"), "--json").stdout)
    assert [r["step"] for r in rows] == [1]


def test_verify_exits_0_for_the_newest_and_2_with_the_reason_when_truncated(job):
    folder, _ = job
    ok = kc("verify", str(folder))
    assert ok.exit_code == 0 and "verified: step 2" in ok.stdout
    truncate_a_shard(folder / "step_00000002")
    bad = kc("verify", str(folder))
    assert bad.exit_code == 2
    assert "error:" in bad.stderr and "the manifest says" in bad.stderr and "kc checkpoint list" in bad.stderr
    assert kc("verify", str(folder / "step_00000001")).exit_code == 0
    as_json = kc("verify", str(folder), "--json")
    assert as_json.exit_code == 2 and json.loads(as_json.stdout)["verified"] is False


def test_verify_reports_a_missing_manifest(job):
    folder, _ = job
    (folder / "step_00000002" / "manifest.json").unlink()
    out = kc("verify", str(folder / "step_00000002"))
    assert out.exit_code == 2 and "partial" in out.stderr


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_export_writes_the_model_weights_only(job, tmp_path, fmt):
    folder, model = job
    out_file = tmp_path / f"model.{fmt}"
    out = kc("export", str(folder), "--format", fmt, "--out", str(out_file))
    assert out.exit_code == 0, out.stderr
    assert "step 2" in out.stdout
    tensors = load_file(out_file) if fmt == "safetensors" else torch.load(out_file, weights_only=True)
    expected = model.state_dict()
    assert set(tensors) == set(expected)
    for k, v in expected.items():
        assert torch.equal(tensors[k], v), k


def test_export_refuses_a_checkpoint_that_does_not_verify(job, tmp_path):
    folder, _ = job
    truncate_a_shard(folder / "step_00000002")
    out_file = tmp_path / "m.safetensors"
    out = kc("export", str(folder), "--out", str(out_file))
    assert out.exit_code == 2 and "not exporting it" in out.stderr and not out_file.exists()
    # An older step that verifies can still be exported by naming its folder.
    assert kc("export", str(folder / "step_00000001"), "--out", str(out_file)).exit_code == 0


@pytest.mark.parametrize("args, message", [
    (["--format", "onnx"], "unknown --format 'onnx'"),
    (["--out", "{tmp}/missing/m.pt"], "does not exist"),
    (["--out", "{tmp}"], "is a folder"),
    (["--out", "{tmp}/a-file/m.pt"], "is not a folder"),
])
def test_export_exits_2_on_bad_options(job, tmp_path, args, message):
    folder, _ = job
    (tmp_path / "a-file").write_text("x")
    args = [a.format(tmp=tmp_path) for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "m.pt")]
    out = kc("export", str(folder), *args)
    assert out.exit_code == 2 and message in out.stderr, out.stderr


def test_missing_paths_and_folders_without_checkpoints_exit_2(tmp_path):
    out = kc("verify", str(tmp_path / "nope"))
    assert out.exit_code == 2 and "does not exist" in out.stderr
    (tmp_path / "empty").mkdir()
    out = kc("verify", str(tmp_path / "empty"))
    assert out.exit_code == 2 and "no checkpoints" in out.stderr
    assert kc("list", str(tmp_path / "empty")).exit_code == 0
    (tmp_path / "f").write_text("x")
    assert kc("list", str(tmp_path / "f")).exit_code == 2


def test_a_job_id_resolves_to_its_checkpoint_folder(job, monkeypatch):
    folder, _ = job

    class Store:
        def get(self, job_id):
            if job_id != "job-1":
                raise JobNotFound(f"no job with id {job_id!r}; `kc list` shows the known jobs")
            return JobRecord(id="job-1", name="j", spec={"checkpoint": {"path": str(folder.parent)}})

    monkeypatch.setattr(JobStore, "from_url", classmethod(lambda cls, url, prefix="kc:": Store()))
    assert [r["step"] for r in json.loads(kc("list", "job-1", "--json").stdout)] == [1, 2]
    out = kc("verify", "job-2")
    assert out.exit_code == 2 and "no job with id 'job-2'" in out.stderr
