"""`kc drill`: bad input exits 2 with what to change, before any link is touched."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kuangchao.api.cli.main import app
from kuangchao.platform.cluster.netplan import NetworkSpec, plan_network

runner = CliRunner()


def _stack(tmp_path, monkeypatch, net: bool) -> None:
    monkeypatch.setenv("KC_HOME", str(tmp_path))
    state = {"ray_port": 1, "temp_dir": str(tmp_path / "t")}
    if net:
        state["net"] = plan_network("ab12", 7, NetworkSpec(2, 0.5),
                                    [("node-0", "l0"), ("node-1", "l1")]).to_json()
    (tmp_path / "cluster.json").write_text(json.dumps(state))


def test_without_a_netns_stack_a_drill_says_what_it_needs(tmp_path, monkeypatch):
    _stack(tmp_path, monkeypatch, net=False)
    out = runner.invoke(app, ["drill", "cut", "node-0"])
    assert out.exit_code == 2 and "isolation: netns" in out.output


def test_an_unknown_node_is_named_with_the_nodes_there_are(tmp_path, monkeypatch):
    _stack(tmp_path, monkeypatch, net=True)
    out = runner.invoke(app, ["drill", "cut-redis", "node-9"])
    assert out.exit_code == 2 and "no node 'node-9'" in out.output and "node-1" in out.output


def test_a_slow_drill_needs_a_sensible_rate(tmp_path, monkeypatch):
    _stack(tmp_path, monkeypatch, net=True)
    out = runner.invoke(app, ["drill", "slow", "node-0", "--gbps", "0"])
    assert out.exit_code == 2 and "--gbps must be between" in out.output


def test_show_lists_the_hosts_and_their_addresses(tmp_path, monkeypatch):
    _stack(tmp_path, monkeypatch, net=True)
    out = runner.invoke(app, ["drill", "show", "--json"])
    doc = json.loads(out.output)
    assert out.exit_code == 0 and doc["redis_addr"] == "198.18.7.2"
    assert [n["addr"] for n in doc["nodes"]] == ["198.18.7.10", "198.18.7.11"]
