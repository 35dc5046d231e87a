"""Alert rules evaluated by promtool over made-up series: when each fires, and when not.

`promtool test rules` runs the rules of deploy/prometheus/alerts.yml against
input series written here, minute by minute, as Prometheus would.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"


def _rule(name: str) -> dict:
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    return next(r for r in rules if r["alert"] == name)


def _promtool_test(tmp_path: Path, tests: list[dict]) -> subprocess.CompletedProcess:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not on PATH: `make tools` installs it (Debian package prometheus)"
    path = tmp_path / "alerts_test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [str(ALERTS)], "evaluation_interval": "1m",
                                    "tests": tests}))
    return subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True,
                          timeout=120)


def test_expert_imbalance_fires_after_ten_minutes_above_twice_the_mean(tmp_path):
    description = _rule("KcExpertImbalance")["annotations"]["description"]
    series = "kc_job_expert_imbalance_ratio{job=\"%s\", instance=\"api\"}"
    tests = [{
        "interval": "1m",
        "input_series": [
            {"series": series % "skewed", "values": "3x20"},
            {"series": series % "even", "values": "1.5x20"},  # under the threshold
            {"series": series % "settled", "values": "3x5 1.2x15"},  # back to even in time
        ],
        "alert_rule_test": [
            {"eval_time": "9m", "alertname": "KcExpertImbalance", "exp_alerts": []},
            {"eval_time": "15m", "alertname": "KcExpertImbalance", "exp_alerts": [{
                "exp_labels": {"severity": "warning", "job": "skewed"},
                "exp_annotations": {
                    "summary": "Job skewed's busiest expert gets 3.0x the mean load",
                    "description": description}}]},
        ],
    }]
    out = _promtool_test(tmp_path, tests)
    assert out.returncode == 0, out.stdout + out.stderr
