"""`kc checkpoint list|verify|export` straight from an object store (a real S3 server):
list reads manifests and object sizes, verify and export fetch the step and check
every checksum first, and what is broken or unreachable exits 2 with the reason."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from kuangchao.platform.storage.access import forget_job_credentials
from kuangchao.workers.checkpoint.manager import CheckpointManager
from kuangchao.workers.models.factory import build_model
from tests.checkpoint_folders import CFG, checkpoint_cli
from tests.s3server import S3Server

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
BUCKET = "kc-cli"
JOB = f"s3://{BUCKET}/ckpt/job-1"


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture
def saved(s3, tmp_path, monkeypatch):
    """Checkpoints at steps 1 and 2 in the store; the model's weights at step 1."""
    s3.use_admin_env(monkeypatch)
    monkeypatch.setenv("KC_HOME", str(tmp_path))
    forget_job_credentials()
    torch.manual_seed(0)
    model = build_model(CFG)
    opt = torch.optim.AdamW(model.parameters())
    mgr = CheckpointManager(f"s3://{BUCKET}/ckpt", "job-1", 0, 1, "h")
    mgr.save(1, model, opt, rank_state={})
    at_step_1 = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.tok_emb.weight.add_(1.0)
    mgr.save(2, model, opt, rank_state={})
    yield at_step_1
    client = s3.client()
    for o in client.list_objects_v2(Bucket=BUCKET).get("Contents", []):
        client.delete_object(Bucket=BUCKET, Key=o["Key"])


def test_list_verify_and_export_from_the_store(saved, s3, tmp_path):
    out = checkpoint_cli("list", JOB)
    assert out.exit_code == 0, out.output
    lines = [ln for ln in out.output.splitlines() if "step_0" in ln]
    assert len(lines) == 2 and all(" yes " in ln for ln in lines), out.output
    out = checkpoint_cli("verify", JOB)
    assert out.exit_code == 0 and "verified: step 2" in out.output, out.output

    exported = tmp_path / "w.safetensors"
    out = checkpoint_cli("export", f"{JOB}/step_00000001", "--out", str(exported))
    assert out.exit_code == 0, out.output
    weights = load_file(str(exported))
    assert set(weights) == set(saved)
    assert all(torch.equal(weights[k], saved[k]) for k in saved)


def test_a_truncated_object_shows_in_list_and_fails_verify(saved, s3):
    client = s3.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="ckpt/job-1/step_00000002/")
            ["Contents"] if o["Key"].endswith(".distcp")]
    client.put_object(Bucket=BUCKET, Key=keys[0], Body=b"short")
    out = checkpoint_cli("list", JOB)
    assert out.exit_code == 0 and "not verified" in out.output and "the manifest says" in out.output
    out = checkpoint_cli("verify", JOB)
    assert out.exit_code == 2 and "the manifest says" in out.stderr, out.output
    out = checkpoint_cli("export", JOB, "--out", "/tmp/never.safetensors")
    assert out.exit_code == 2 and "not exporting it" in out.stderr


def test_a_missing_bucket_or_a_bad_url_exits_2_with_the_reason(saved):
    out = checkpoint_cli("list", "s3://no-such-bucket/ckpt/job-1")
    assert out.exit_code == 2 and "does not exist" in out.stderr, out.output
    out = checkpoint_cli("list", "s3://bucket-only")
    assert out.exit_code == 2 and "names a bucket" in out.stderr, out.output
    assert "Traceback" not in out.output
