"""Bad input to `kc` ends with exit code 2 and a message, never a traceback."""

import json
import subprocess
import sys
from pathlib import Path

from kuangchao.platform.runtime.procs import free_port

ROOT = Path(__file__).resolve().parents[2]


def kc(*args, env_extra=None, tmp_home=None):
    import os
    env = {**os.environ, "KC_HOME": str(tmp_home), **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "kuangchao.api.cli", *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=60)


def test_submit_exits_2_with_field_paths_when_spec_is_malformed(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("model: {n_heads: 12, d_model: 96}\nparallel: {tensor_parallel_size: 5}\n")
    out = kc("submit", str(spec), tmp_home=tmp_path)
    assert out.returncode == 2
    assert "parallel.tensor_parallel_size: 5 does not divide model.n_heads (12)" in out.stderr
    assert "Traceback" not in out.stderr


def test_submit_exits_2_when_set_override_is_malformed(tmp_path):
    out = kc("submit", str(ROOT / "examples/tiny-gpt.yaml"), "--set", "training.steps",
             tmp_home=tmp_path)
    assert out.returncode == 2 and "section.field=value" in out.stderr


def test_status_exits_2_with_hint_when_api_is_unreachable(tmp_path):
    out = kc("status", "nope", tmp_home=tmp_path,
             env_extra={"KC_API_URL": f"http://127.0.0.1:{free_port()}"})
    assert out.returncode == 2
    assert "cannot reach the kuangchao API" in out.stderr and "kc up" in out.stderr
    assert "Traceback" not in out.stderr


def test_unknown_flag_exits_2(tmp_path):
    out = kc("list", "--bogus", tmp_home=tmp_path)
    assert out.returncode == 2


def test_up_exits_2_when_cluster_file_is_missing(tmp_path):
    out = kc("up", "--cluster", str(tmp_path / "none.yaml"), "--api-port", str(free_port()),
             "--dashboard-port", str(free_port()), tmp_home=tmp_path)
    assert out.returncode == 2 and "does not exist" in out.stderr


def test_down_says_nothing_to_stop_when_nothing_runs(tmp_path):
    out = kc("down", tmp_home=tmp_path)
    assert out.returncode == 0 and "nothing to stop" in out.stdout


def test_place_prints_plan_and_score_without_running_anything(tmp_path):
    out = kc("place", str(ROOT / "examples/tiny-gpt.yaml"), "--cluster",
             str(ROOT / "examples/cluster-4x8.yaml"), "--set", "parallel.tensor_parallel_size=4",
             "--set", "parallel.data_parallel_size=4", "--json", tmp_home=tmp_path)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["feasible"] and result["score"]["tp_groups_split"] == 0
    assert [r["rank"] for r in result["plan"]] == list(range(16))


def test_place_exits_1_with_reason_when_the_job_cannot_fit(tmp_path):
    out = kc("place", str(ROOT / "examples/tiny-gpt.yaml"), "--cluster",
             str(ROOT / "examples/cluster-2x4.yaml"), "--set", "parallel.data_parallel_size=9",
             tmp_home=tmp_path)
    assert out.returncode == 1 and "needs 9 GPUs, the cluster has 8" in out.stdout


def test_an_unreadable_or_empty_redis_url_file_exits_2_naming_it(tmp_path):
    """KC_REDIS_URL_FILE is read with the settings, before any command's own
    handling: the message still says which setting to fix, and no traceback."""
    for path, says in ((tmp_path / "absent", "cannot read KC_REDIS_URL_FILE"),
                       (tmp_path / "empty", "is empty")):
        if path.name == "empty":
            path.write_text("\n")
        out = kc("list", tmp_home=tmp_path, env_extra={"KC_REDIS_URL_FILE": str(path)})
        assert out.returncode == 2 and says in out.stderr and str(path) in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
