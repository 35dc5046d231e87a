"""`kc checkpoint` as a process: the installed entry point, and a job id with no Redis."""

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kuangchao.api.cli.main import app
from kuangchao.platform.runtime.procs import free_port
from tests.checkpoint_folders import job_with_two_checkpoints, truncate_a_shard

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def job(tmp_path):
    return job_with_two_checkpoints(tmp_path)


def kc(*args: str):
    result = CliRunner().invoke(app, ["checkpoint", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def test_a_job_id_without_redis_exits_2_with_a_hint(tmp_path, monkeypatch):
    monkeypatch.setenv("KC_HOME", str(tmp_path))
    monkeypatch.setenv("KC_REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
    out = kc("list", "some-job")
    assert out.exit_code == 2 and "cannot reach Redis" in out.stderr
    assert "Pass a checkpoint folder instead" in out.stderr


def test_kc_entry_point_has_the_checkpoint_commands(job, tmp_path):
    folder, _ = job
    truncate_a_shard(folder / "step_00000002")
    out = subprocess.run([sys.executable, "-m", "kuangchao.api.cli", "checkpoint", "verify", str(folder)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={"KC_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2 and "the manifest says" in out.stderr
    assert "Traceback" not in out.stderr
