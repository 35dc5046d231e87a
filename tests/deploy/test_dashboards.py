"""Lints the Grafana dashboards, their provisioning and the Prometheus alert rules.

No Grafana, no Prometheus: the JSON and YAML are read as files and checked
against the metric catalog (`kuangchao.platform.observability.metrics.ALL`), so a renamed
metric or a dashboard pinned to one datasource or one job fails here.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from kuangchao.platform.observability.metrics import ALL

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"

DS_REF = {"type": "prometheus", "uid": "${datasource}"}
BUILTINS = {"__rate_interval", "__range", "__interval"}
CATALOG = {m.name: m for m in ALL}
METRIC_RE = re.compile(r"(?<![A-Za-z0-9_:])kc_[a-z0-9_]+")
JOB_MATCHER_RE = re.compile(r'\bjob\s*(?:=~|!~|!=|=)\s*"([^"]*)"')
VAR_RE = re.compile(r"\$\{?(\w+)")


def unknown_metrics(expr: str) -> list[str]:
    """kc_ names in `expr` that the catalog does not declare (histogram suffixes allowed)."""
    out = []
    for name in METRIC_RE.findall(expr):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if name in CATALOG or (base in CATALOG and CATALOG[base].kind == "histogram"):
            continue
        out.append(name)
    return out


def all_panels(dash: dict) -> list[dict]:
    """Every panel, including those nested in (collapsed) rows."""
    out = []
    for p in dash.get("panels", []):
        out.append(p)
        out += p.get("panels", [])
    return out


def _overlaps(panels: list[dict]) -> list[str]:
    out, boxes = [], []
    for p in panels:
        g = p.get("gridPos")
        if not g or not all(k in g for k in "xywh"):
            out.append(f"panel {p.get('title')!r}: no gridPos")
            continue
        if g["x"] < 0 or g["w"] <= 0 or g["x"] + g["w"] > 24:
            out.append(f"panel {p.get('title')!r}: gridPos outside the 24 columns")
        for title, o in boxes:
            if (g["x"] < o["x"] + o["w"] and o["x"] < g["x"] + g["w"]
                    and g["y"] < o["y"] + o["h"] and o["y"] < g["y"] + g["h"]):
                out.append(f"panels {title!r} and {p.get('title')!r} overlap")
        boxes.append((p.get("title"), g))
    return out


def _variable_query(var: dict) -> str:
    q = var.get("query", "")
    return q.get("query", "") if isinstance(q, dict) else str(q)


def dashboard_problems(dash: dict) -> list[str]:
    """What is wrong with one dashboard; [] when it passes every rule."""
    out = [f"missing top-level {k!r}" for k in ("uid", "title", "panels") if not dash.get(k)]
    variables = dash.get("templating", {}).get("list", [])
    names = {v.get("name") for v in variables}
    if not any(v.get("name") == "datasource" and v.get("type") == "datasource"
               for v in variables):
        out.append("no `datasource` templating variable")
    exprs = [(f"variable {v.get('name')!r}", _variable_query(v))
             for v in variables if v.get("type") == "query"]
    for v in variables:
        if v.get("type") == "query" and v.get("datasource") != DS_REF:
            out.append(f"variable {v.get('name')!r}: datasource is not ${{datasource}}")

    ids: set = set()
    for p in all_panels(dash):
        title = p.get("title")
        if p.get("id") in ids:
            out.append(f"duplicate panel id {p.get('id')} ({title!r})")
        ids.add(p.get("id"))
        if p.get("type") == "row":
            continue
        if p.get("datasource") != DS_REF:
            out.append(f"panel {title!r}: datasource {p.get('datasource')!r}")
        for t in p.get("targets", []):
            if t.get("datasource") != DS_REF:
                out.append(f"panel {title!r} target {t.get('refId')}: datasource "
                           f"{t.get('datasource')!r}")
            exprs.append((f"panel {title!r}", t.get("expr", "")))

    for where, expr in exprs:
        for value in JOB_MATCHER_RE.findall(expr):
            if value not in ("$job", "${job}"):
                out.append(f"{where}: job matcher {value!r} is not $job")
        for var in VAR_RE.findall(expr):
            if var not in names and var not in BUILTINS:
                out.append(f"{where}: unknown variable ${var}")
        out += [f"{where}: {m} is not in the metric catalog" for m in unknown_metrics(expr)]

    out += _overlaps(dash.get("panels", []))
    for row in dash.get("panels", []):
        if row.get("panels"):
            out += _overlaps(row["panels"])
    return out


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def test_there_are_the_four_dashboards_with_distinct_uids():
    uids = {p.stem: load(p)["uid"] for p in DASHBOARDS}
    assert uids == {"cluster-overview": "kc-cluster", "job-detail": "kc-job",
                    "fault-tolerance": "kc-fault", "scheduler": "kc-scheduler"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_passes_every_rule(path):
    dash = load(path)
    assert dashboard_problems(dash) == []
    assert "kuangchao" in dash["tags"]
    for p in all_panels(dash):
        if p.get("type") != "row":
            assert p.get("description"), p.get("title")
            assert p.get("fieldConfig", {}).get("defaults", {}).get("unit"), p.get("title")


def test_the_lint_reports_what_it_should():
    dash = load(GRAFANA / "dashboards" / "job-detail.json")
    assert dashboard_problems(dash) == []
    broken = {
        "duplicate panel id": lambda d: d["panels"][1].update(id=d["panels"][0]["id"]),
        "'Progress': datasource {'uid'": lambda d: d["panels"][0].update(
            datasource={"uid": "kc-prometheus"}),
        "target A: datasource": lambda d: d["panels"][0]["targets"][0].update(datasource=None),
        "is not $job": lambda d: d["panels"][0]["targets"][0].update(
            expr='kc_job_step{job="3f9c2a"}'),
        "unknown variable $node": lambda d: d["panels"][0]["targets"][0].update(
            expr='kc_job_step{job="$job", node="$node"}'),
        "kc_job_stepz is not in the metric catalog": lambda d: d["panels"][0]["targets"][0]
        .update(expr='kc_job_stepz{job="$job"}'),
        "overlap": lambda d: d["panels"][1].update(gridPos=dict(d["panels"][0]["gridPos"])),
        "no gridPos": lambda d: d["panels"][1].pop("gridPos"),
        "no `datasource` templating variable": lambda d: d["templating"]["list"].pop(0),
        "duplicate panel id 1": lambda d: d["panels"].append(
            {"type": "row", "id": 99, "title": "r", "gridPos": {"x": 0, "y": 99, "w": 24, "h": 1},
             "panels": [{**copy.deepcopy(d["panels"][0]), "id": 1}]}),
    }
    for expected, mutate in broken.items():
        d = copy.deepcopy(dash)
        mutate(d)
        assert any(expected in p for p in dashboard_problems(d)), expected


def test_histogram_suffixes_only_strip_from_histograms():
    assert unknown_metrics("rate(kc_queue_wait_seconds_bucket[5m]) + kc_jobs") == []
    assert unknown_metrics("kc_jobs_count + kc_job_restarts_total") == ["kc_jobs_count"]


def test_catalog_counters_end_in_total():
    assert [m.name for m in ALL if m.kind == "counter" and not m.name.endswith("_total")] == []


def test_datasource_provisioning():
    doc = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())
    assert doc["apiVersion"] == 1
    (ds,) = doc["datasources"]
    assert (ds["name"], ds["uid"], ds["type"]) == ("Prometheus", "kc-prometheus", "prometheus")
    assert ds["url"] == "http://prometheus:9090" and ds["isDefault"] is True


def test_dashboard_provider_provisioning():
    doc = yaml.safe_load((GRAFANA / "provisioning/dashboards/kuangchao.yml").read_text())
    assert doc["apiVersion"] == 1
    (provider,) = doc["providers"]
    assert provider["name"] == provider["folder"] == "kuangchao"
    assert provider["type"] == "file" and provider["allowUiUpdates"] is False
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards/kuangchao"


def test_alerts_are_annotated_and_use_catalog_metrics():
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    assert rules
    for rule in rules:
        name = rule["alert"]
        assert {"summary", "description"} <= set(rule.get("annotations", {})), name
        assert rule.get("labels", {}).get("severity") in ("warning", "critical"), name
        assert unknown_metrics(rule["expr"]) == [], name
