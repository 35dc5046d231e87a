"""`PATCH /v1/nodes/{name}` and `kc node set`: an operator overrides a node's GPU
type and emulated speed; bad values get a 422 (exit 2) naming the field; the
node view and `kc nodes` show the type. In process, on the in-memory store."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from kuangchao.api.cli import main, nodes
from kuangchao.api.sdk.client import Client
from kuangchao.api.server.app import create_app
from kuangchao.api.server.dependencies import auth
from kuangchao.platform.cluster.overrides import OVERRIDES_INFO
from kuangchao.platform.cluster.registry import current_nodes
from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.jobs.memory import MemoryStore
from kuangchao.platform.security.keystore import KeyStore
from tests.unit.api_fakes import memory_api

FAKE = NodeInfo(name="node-0", gpus=2, islands=((0, 1),), leaf="leaf-0", gpu_type="a100-80gb")
REAL = NodeInfo(name="gpu-0", gpus=8, islands=(tuple(range(8)),), leaf="leaf-0",
                accelerator="H100", gpu_type="h100-80gb")
RAY = [{"NodeID": "a" * 56, "Alive": True, "Resources": {"CPU": 2, "GPU": 2},
        "Labels": FAKE.labels()},
       {"NodeID": "b" * 56, "Alive": True, "Resources": {"CPU": 2, "GPU": 8, "accelerator_type:H100": 1},
        "Labels": REAL.labels()}]


@pytest.fixture
def api(monkeypatch, tmp_path):
    store = memory_api(monkeypatch, tmp_path)
    store.set_info("nodes", {"nodes": [FAKE.to_json(), REAL.to_json()], "updated_at": 1.0})
    clients = {}
    for role in ("operator", "submitter"):
        key, _ = KeyStore(store).create(role, "default", role)
        clients[role] = TestClient(create_app(), headers={"Authorization": f"Bearer {key}"})
    yield store, clients
    auth._trail.cache_clear()


def refresh(store: MemoryStore) -> None:
    """What the registry does each scheduling cycle: its view, overrides applied."""
    store.set_info("nodes", {"nodes": [n.to_json() for n in current_nodes(store, RAY)],
                             "updated_at": 2.0})


def test_an_operator_overrides_a_nodes_type_and_speed_and_the_view_shows_it(api):
    store, clients = api
    resp = clients["operator"].patch("/v1/nodes/node-0", json={"gpu_type": "H100-80GB",
                                                                "emulated_speed": 0.5})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"node": "node-0",
                           "overrides": {"gpu_type": "h100-80gb", "emulated_speed": 0.5}}
    refresh(store)
    view = {n["name"]: n for n in clients["operator"].get("/v1/nodes").json()["nodes"]}
    assert (view["node-0"]["gpu_type"], view["node-0"]["emulated_speed"]) == ("h100-80gb", 0.5)
    assert view["node-0"]["overrides"] == {"gpu_type": "h100-80gb", "emulated_speed": 0.5}
    assert view["gpu-0"]["overrides"] is None and view["gpu-0"]["gpu_type"] == "h100-80gb"
    (record,) = [json.loads(line) for line in store.audit_lines(None)
                 if json.loads(line)["action"] == "node.set"]
    assert record["decision"] == "allow" and record["resource"] == "node/node-0"

    # null clears one field's override: the node goes back to its label's type.
    resp = clients["operator"].patch("/v1/nodes/node-0", json={"gpu_type": None})
    assert resp.json() == {"node": "node-0", "overrides": {"emulated_speed": 0.5}}
    refresh(store)
    (n0,) = [n for n in clients["operator"].get("/v1/nodes").json()["nodes"] if n["name"] == "node-0"]
    assert (n0["gpu_type"], n0["emulated_speed"]) == ("a100-80gb", 0.5)


@pytest.mark.parametrize("node, body, field, message", [
    ("node-0", {"gpu_type": "b200"}, "gpu_type",
     "'b200' is not a GPU type in the catalogue; known types: a100-40gb, a100-80gb, h100-80gb, "
     "h200-141gb"),
    ("node-0", {"emulated_speed": 1.5}, "emulated_speed", "must be a number in (0, 1]"),
    ("node-0", {"emulated_speed": 0}, "emulated_speed", "must be a number in (0, 1]"),
    ("gpu-0", {"emulated_speed": 0.5}, "emulated_speed",
     "emulated_speed: node gpu-0 has real GPUs (H100 detected); emulation is for fake clusters only"),
    ("node-0", {"emulated_speed": "slow"}, "body.emulated_speed", "valid number"),
    ("node-0", {"speed": 0.5}, "body.speed", "Extra inputs"),
])
def test_bad_overrides_get_a_422_naming_the_field_and_store_nothing(api, node, body, field, message):
    store, clients = api
    resp = clients["operator"].patch(f"/v1/nodes/{node}", json=body)
    assert resp.status_code == 422, resp.text
    (problem,) = resp.json()["detail"]
    assert problem["field"] == field and message in problem["msg"]
    assert store.info(OVERRIDES_INFO) is None


def test_an_unknown_node_is_404_and_a_submitter_may_not_override(api):
    _, clients = api
    resp = clients["operator"].patch("/v1/nodes/nope", json={"gpu_type": "h100-80gb"})
    assert resp.status_code == 404 and "`kc nodes` lists the nodes" in resp.json()["detail"]
    resp = clients["submitter"].patch("/v1/nodes/node-0", json={"gpu_type": "h100-80gb"})
    assert resp.status_code == 403 and "may not node.manage" in resp.json()["detail"]


@pytest.fixture
def cli(api, monkeypatch):
    store, clients = api
    c = Client("http://testserver")
    c._http = clients["operator"]
    monkeypatch.setattr(nodes, "client", lambda: c)
    return store, lambda *args: CliRunner().invoke(main.app, list(args))


def test_kc_node_set_reports_the_servers_refusal_and_exits_2(cli):
    store, run = cli
    out = run("node", "set", "gpu-0", "--emulated-speed", "0.5")
    assert out.exit_code == 2
    assert "emulated_speed: node gpu-0 has real GPUs (H100 detected)" in out.output
    out = run("node", "set", "node-0", "--gpu-type", "b200")
    assert out.exit_code == 2 and "gpu_type: 'b200' is not a GPU type" in out.output
    assert run("node", "set", "node-0").exit_code == 2
    assert run("node", "set", "node-0", "--gpu-type", "h100-80gb", "--clear-gpu-type").exit_code == 2
    assert store.info(OVERRIDES_INFO) is None


def test_kc_node_set_then_kc_nodes_shows_the_type_and_the_emulated_speed(cli):
    store, run = cli
    out = run("node", "set", "node-0", "--gpu-type", "h100-80gb", "--emulated-speed", "0.5")
    assert out.exit_code == 0, out.output
    assert "node-0: gpu_type h100-80gb, emulated_speed 0.5" in out.output
    refresh(store)
    out = run("nodes")
    assert out.exit_code == 0, out.output
    header, *rows = out.output.splitlines()
    assert "TYPE" in header
    row = next(r for r in rows if r.startswith("node-0"))
    assert "h100-80gb@0.5x*" in row
    assert "h100-80gb " in next(r for r in rows if r.startswith("gpu-0"))
    out = run("node", "set", "node-0", "--clear-gpu-type", "--clear-emulated-speed", "--json")
    assert json.loads(out.output) == {"node": "node-0", "overrides": {}}


@pytest.mark.parametrize("flags, message", [
    (["--gpus", "1", "--gpu-type", "b200"], "--gpu-type: 'b200' is not a GPU type"),
    (["--gpus", "1", "--emulated-speed", "1.5"], "--emulated-speed: must be a number in (0, 1]"),
    (["--emulated-speed", "0.5"], "--emulated-speed: this node offers no GPUs"),
])
def test_kc_node_join_refuses_bad_gpu_flags_before_starting_anything(monkeypatch, tmp_path,
                                                                     flags, message):
    from kuangchao.platform.cluster import nodejoin

    monkeypatch.setenv("KC_HOME", str(tmp_path))
    monkeypatch.setattr(nodejoin, "detect_gpus", lambda: None)
    monkeypatch.setattr(nodejoin, "query_gpus", lambda: None)
    # `join` checks the node first (node_for), then runs `ray start`: keep only the check.
    monkeypatch.setattr(nodejoin, "join", lambda opts, block=False: nodejoin.node_for(opts))
    out = CliRunner().invoke(main.app, ["node", "join", "--address", "h:1", "--leaf", "l",
                                        "--name", "n", *flags])
    assert out.exit_code == 2 and message in out.output, out.output
