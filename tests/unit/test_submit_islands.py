"""Submission refuses a tensor-parallel group that no NVLink island of the job's GPU
types can hold (issue 25): 422 naming `parallel.tensor_parallel_size`, checked
against the registry's published node view; skipped while there is none."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kuangchao.api.server.app import create_app
from kuangchao.api.server.dependencies import auth
from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.jobs.memory import MemoryStore
from kuangchao.platform.security.keystore import KeyStore
from tests.unit.api_fakes import memory_api


def spec(tp: int, types: list[str]) -> dict:
    return {"task": {"name": "tp"}, "model": {"n_layers": 1, "n_heads": 8, "d_model": 64,
                                              "seq_len": 32},
            "parallel": {"data_parallel_size": 1, "tensor_parallel_size": tp},
            "resources": {"gpu_types": types}, "training": {"steps": 5}}


def publish(store: MemoryStore) -> None:
    """A100 nodes with islands of 4 GPUs, H100 nodes with one island of 8."""
    nodes = [NodeInfo(name="a0", gpus=8, islands=((0, 1, 2, 3), (4, 5, 6, 7)), leaf="l",
                      gpu_type="a100-80gb"),
             NodeInfo(name="h0", gpus=8, islands=(tuple(range(8)),), leaf="l",
                      gpu_type="h100-80gb")]
    store.set_info("nodes", {"nodes": [n.to_json() for n in nodes]})


@pytest.fixture
def api(monkeypatch, tmp_path):
    store = memory_api(monkeypatch, tmp_path)
    key, _ = KeyStore(store).create("alice", "team-a", "submitter")
    client = TestClient(create_app())
    client.headers["Authorization"] = f"Bearer {key}"
    yield store, client
    auth._trail.cache_clear()


def test_a_tp_group_larger_than_the_islands_of_its_types_gets_422(api):
    store, client = api
    publish(store)
    resp = client.post("/v1/jobs", json=spec(8, ["a100-80gb"]))
    assert resp.status_code == 422, resp.text
    (err,) = resp.json()["detail"]
    assert err["field"] == "parallel.tensor_parallel_size"
    assert err["loc"] == ["parallel", "tensor_parallel_size"]
    assert err["msg"].startswith("8 GPUs per tensor-parallel group (8 x 1 GPUs per rank) do not "
                                 "fit the largest single-type NVLink island (4 GPUs on a100-80gb "
                                 "nodes); lower parallel.tensor_parallel_size to 4 or less")
    assert store.list(10) == []  # nothing was queued
    dry = client.post("/v1/jobs?dry_run=true", json=spec(8, ["a100-80gb"]))
    assert dry.status_code == 422  # a dry run says the same


@pytest.mark.parametrize("tp, types, published", [
    (8, ["h100-80gb"], True),   # the H100 island holds 8
    (8, [], True),              # any type: the H100s will do
    (4, ["a100-80gb"], True),
    (8, ["a100-80gb"], False),  # no node view yet: the scheduler explains any wait
])
def test_a_tp_group_that_fits_some_island_is_queued(api, tp, types, published):
    store, client = api
    if published:
        publish(store)
    resp = client.post("/v1/jobs", json=spec(tp, types))
    assert resp.status_code == 201, resp.text


def test_an_unknown_gpu_type_gets_422_naming_the_field(api):
    _, client = api
    resp = client.post("/v1/jobs", json=spec(1, ["v100"]))
    assert resp.status_code == 422
    (err,) = resp.json()["detail"]
    assert err["field"] == "resources.gpu_types"
    assert err["msg"].startswith("'v100' is not a GPU type in the catalogue; choose from ")
