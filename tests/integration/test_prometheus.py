"""The dashboards and alert rules against real data.

A real Prometheus (Debian's package; `make test` installs it) scrapes the
session's live stack with deploy/prometheus/prometheus.yml, adapted only in
where things are (ports, files) and how often it scrapes. A job (a mixture of
experts, so that the routing panels have series too) trains, checkpoints, loses
a rank to SIGKILL and recovers. Then every PromQL
expression of every dashboard panel and every alert rule must return a
non-empty, finite result over the series Prometheus scraped; alert rules are
evaluated with their comparison in its `bool` form, so that an inactive
alert still shows its signal.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from kuangchao.platform.runtime import procs
from kuangchao.workers.models.tiny_hf import tiny_tokenizer, write_datasets

from .conftest import ROOT, wait_for

pytestmark = pytest.mark.integration

DEPLOY = ROOT / "deploy"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
ALERTS = DEPLOY / "prometheus" / "alerts.yml"


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path, (f"{name} is not installed: `make test` installs Debian's `prometheus` package "
                  "(apt-get install prometheus)")
    return path


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=30)

    def query(self, expr: str) -> dict:
        r = self.http.get("/api/v1/query", params={"query": expr})
        body = r.json()
        assert body.get("status") == "success", f"{expr}: {body}"
        return body["data"]

    def vector(self, expr: str) -> list[dict]:
        return self.query(expr)["result"]

    def value(self, expr: str) -> float | None:
        res = self.vector(expr)
        return float(res[0]["value"][1]) if res else None


def adapt_config(stack, rules: Path) -> dict:
    """deploy/prometheus/prometheus.yml, pointed at this stack and scraping every second."""
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str(rules)]
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == {"kc-api", "kc-workers", "ray"}
    api = jobs["kc-api"]
    api["static_configs"] = [{"targets": [stack.state["api_url"].removeprefix("http://")]}]
    api["authorization"]["credentials_file"] = stack.state["metrics_token_file"]
    jobs["kc-workers"]["file_sd_configs"][0]["files"] = [stack.state["metrics_sd_file"]]
    jobs["kc-workers"]["file_sd_configs"][0]["refresh_interval"] = "1s"
    jobs["ray"]["file_sd_configs"][0]["files"] = [
        str(Path(stack.state["temp_dir"]) / "prom_metrics_service_discovery.json")]
    return cfg


@pytest.fixture(scope="module")
def prom(stack, tmp_path_factory):
    promtool = _tool("promtool")
    binary = _tool("prometheus")
    work = tmp_path_factory.mktemp("prometheus")
    config = work / "prometheus.yml"
    config.write_text(yaml.safe_dump(adapt_config(stack, ALERTS)))
    sd = Path(stack.state["metrics_sd_file"])
    wait_for(sd.exists, 60, f"the API server to write {sd}")
    for args in (["check", "config", str(config)], ["check", "rules", str(ALERTS)],
                 ["check", "config", "--syntax-only", str(DEPLOY / "prometheus" / "prometheus.yml")]):
        out = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"promtool {' '.join(args)}:\n{out.stdout}{out.stderr}"
    port = procs.free_port()
    log = open(work / "prometheus.log", "wb")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    p = Prometheus(f"http://127.0.0.1:{port}")
    try:
        wait_for(lambda: _ready(p), 120, "Prometheus to be ready")
        yield p
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()


def _ready(p: Prometheus) -> bool:
    try:
        return p.http.get("/-/ready").status_code == 200
    except httpx.HTTPError:
        return False


def bool_form(expr: str) -> str:
    """`signal > threshold` as `signal > bool threshold`: 0 or 1 for every series of
    the signal instead of only the firing ones. Exactly one top-level comparison."""
    depth, quote, found = 0, "", []
    i = 0
    while i < len(expr):
        c = expr[i]
        if quote:
            quote = "" if c == quote and expr[i - 1] != "\\" else quote
        elif c in "\"'`":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and c in "<>=!":
            op = expr[i:i + 2] if expr[i:i + 2] in ("==", "!=", ">=", "<=") else c
            if op in ("==", "!=", ">=", "<=", ">", "<"):
                found.append((i, op))
                i += len(op)
                continue
        i += 1
    assert len(found) == 1, f"expected one top-level comparison in {expr!r}, found {found}"
    at, op = found[0]
    return f"{expr[:at + len(op)]} bool{expr[at + len(op):]}"


def test_bool_form_finds_the_top_level_comparison():
    assert bool_form('max by (job) (x{state="A"}) > 900') == 'max by (job) (x{state="A"}) > bool 900'
    assert bool_form("a != a") == "a != bool a"
    assert bool_form('min(up{job=~"k.*"}) < 1') == 'min(up{job=~"k.*"}) < bool 1'
    with pytest.raises(AssertionError):
        bool_form("sum(rate(x[5m]))")


def panel_exprs(dashboard: dict) -> list[tuple[str, str]]:
    out = []
    for panel in dashboard["panels"]:
        for sub in [panel, *panel.get("panels", [])]:
            for target in sub.get("targets", []):
                if target.get("expr"):
                    out.append((f"{dashboard['uid']}/{sub['title']}", target["expr"]))
    return out


def substitute(expr: str, job_id: str, range_s: int) -> str:
    for var, value in (("$__rate_interval", "1m"), ("$__range", f"{range_s}s"),
                       ("$__interval", "15s"), ("${job}", job_id), ("$job", job_id),
                       ("${rank}", ".*"), ("$rank", ".*")):
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def test_dashboards_and_alerts_evaluate_over_live_series(stack, prom):
    started = time.time()
    wait_for(lambda: prom.value('min(up{job="kc-api"})') == 1.0, 120,
             "Prometheus to scrape the API")
    wait_for(lambda: prom.value("kc_store_up") == 1.0, 60, "the control-plane series")
    wait_for(lambda: prom.value('count(kc_placement_solve_seconds_count)') == 1.0, 60,
             "the zero series of the recorded histograms")
    doc = stack.job_doc(training={"steps": 100_000, "seed": 3, "log_interval": 5,
                                  "eval_interval": 5, "eval_batches": 1})
    # Tokenized text with a held-out split, so the eval-loss series exists too.
    data = Path(stack.env["KC_HOME"]) / "data" / "prom-e2e"
    tiny_tokenizer(data / "tokenizer")
    write_datasets(data, n=12)
    doc["data"] = {"path": str(data / "docs.jsonl"), "format": "jsonl",
                   "tokenizer": str(data / "tokenizer"), "eval_fraction": 0.2}
    doc["model"]["vocab_size"] = 512
    # A mixture of experts: every series a dense model has, and the routing gauges too.
    doc["model"].update(type="moe", n_experts=4, top_k=2)
    doc["task"]["name"] = "prom-e2e"
    doc["checkpoint"]["interval_steps"] = 10
    doc["fault_tolerance"] = {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 5}
    # The killed rank is replaced from the checkpoint (not refilled live, the survivor
    # keeping its work): the restore's series exist too.
    doc["elastic"] = {"resize": "restart"}
    job_id = stack.client.submit(doc)["id"]
    try:
        _exercise(stack, prom, job_id)
        range_s = int(time.time() - started) + 30
        problems = []
        for path in DASHBOARDS:
            for where, expr in panel_exprs(json.loads(path.read_text())):
                problems += _check(prom, f"panel {where}", substitute(expr, job_id, range_s))
        rules = yaml.safe_load(ALERTS.read_text())
        for group in rules["groups"]:
            for rule in group["rules"]:
                prom.query(rule["expr"])  # the rule as written evaluates
                problems += _check(prom, f"alert {rule['alert']}", bool_form(rule["expr"]))
        assert not problems, "\n".join(problems)
        # Prometheus evaluated every rule itself, every second, without an error.
        loaded = prom.http.get("/api/v1/rules").json()["data"]["groups"]
        health = {r["name"]: (r["health"], r.get("lastError", "")) for g in loaded for r in g["rules"]}
        assert len(health) == sum(len(g["rules"]) for g in rules["groups"])
        assert all(h == "ok" for h, _ in health.values()), health
    finally:
        if stack.client.get(job_id)["state"] not in ("FAILED", "CANCELLED", "SUCCEEDED"):
            stack.client.cancel(job_id)
        stack.wait_state(job_id, {"CANCELLED", "SUCCEEDED", "FAILED"}, timeout=300)


def _running(stack, job_id: str) -> None:
    def check():
        job = stack.client.get(job_id)
        assert job["state"] not in ("FAILED", "CANCELLED", "SUCCEEDED"), (
            f"{job['state']}: {job.get('message')}\n{stack.client.events(job_id)}")
        return job["state"] == "RUNNING"
    wait_for(check, 300, f"job {job_id} to run")


def _exercise(stack, prom, job_id: str) -> None:
    """Train, checkpoint, lose rank 1 to SIGKILL, recover; Prometheus sees it all."""
    _running(stack, job_id)
    workers = f'kc_worker_step{{job="{job_id}"}}'
    wait_for(lambda: len(prom.vector(workers)) == 2, 120, "both ranks' endpoints in Prometheus")
    for series in prom.vector(workers):  # the target's labels and the series' agree
        assert {"job", "rank", "node"} <= set(series["metric"]), series
        assert series["metric"]["job"] == job_id
    saved = f'sum(kc_checkpoint_save_seconds_count{{job="{job_id}"}})'
    wait_for(lambda: (prom.value(saved) or 0) >= 1, 180, "a checkpoint in Prometheus")
    pid = next(p["pid"] for p in stack.client.get(job_id)["placement"] if p["rank"] == 1)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: stack.client.get(job_id)["restarts"] >= 1, 120, "the restart")
    _running(stack, job_id)
    for expr, what in ((f'sum(kc_job_restarts_total{{job="{job_id}",cause="died"}})', "restart"),
                       ('sum(kc_failure_detection_seconds_count{cause="died"})', "detection"),
                       (f'sum(kc_checkpoint_load_seconds_count{{job="{job_id}"}})', "restore")):
        wait_for(lambda e=expr: (prom.value(e) or 0) >= 1, 180, f"the {what} in Prometheus")
    # The new rank 1 registered itself; both ranks are scraped again, past the restore.
    wait_for(lambda: len([s for s in prom.vector(f'{workers} > 0')]) == 2, 180,
             "both ranks stepping after the recovery")


def _check(prom, where: str, expr: str) -> list[str]:
    try:
        result = prom.query(expr)
    except AssertionError as exc:
        return [f"{where}: {exc}"]
    if result["resultType"] == "scalar":
        values = [result["result"][1]]
    else:
        values = [s["value"][1] for s in result["result"]]
    if not values:
        return [f"{where}: no series for {expr}"]
    bad = [v for v in values if not math.isfinite(float(v))]
    return [f"{where}: non-finite {bad} for {expr}"] if bad else []
