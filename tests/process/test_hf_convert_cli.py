"""`kc checkpoint convert` and `kc debug checkpoint` as processes: exit codes, no traceback."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoint_folders import job_with_two_checkpoints, truncate_a_shard

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROOT = Path(__file__).resolve().parents[2]


def kc(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "kuangchao.api.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=120,
                          env={"KC_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})


def test_convert_refuses_a_direction_that_makes_no_sense_and_lists_those_that_do(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    out = kc(tmp_path, "checkpoint", "convert", str(tmp_path / "model"), "--out",
             str(tmp_path / "again"), "--to", "hf")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "cannot convert a Hugging Face folder to hf" in out.stderr
    assert "Hugging Face folder -> checkpoint, safetensors or torch" in out.stderr


def test_debug_checkpoint_exits_1_on_a_truncated_shard_and_2_on_no_checkpoint(tmp_path):
    folder, _ = job_with_two_checkpoints(tmp_path)
    ok = kc(tmp_path, "debug", "checkpoint", str(folder))
    assert ok.returncode == 0 and "step_00000002" in ok.stdout, ok.stderr
    truncate_a_shard(folder / "step_00000002")
    bad = kc(tmp_path, "debug", "checkpoint", str(folder / "step_00000002"), "--json")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert "size_mismatch" in {r["status"] for r in json.loads(bad.stdout)["files"]}
    none = kc(tmp_path, "debug", "checkpoint", str(tmp_path / "nothing-here"))
    assert none.returncode == 2 and "does not exist" in none.stderr and "Traceback" not in none.stderr
