"""Roles and device scope enforced (gap 16 of issue 22): a rank takes only the GPUs
its token names, its data reader reads under a data_loader token, and its metrics
endpoint starts under a monitor token. Pure or on the in-memory store; no Ray."""

from __future__ import annotations

import os
import sys
import types

import numpy as np
import pytest

from kuangchao.platform.errors import TokenError
from kuangchao.platform.protocol.interfaces import COLLECTIVES
from kuangchao.platform.security.authority import RANK_MODULES, TokenAuthority
from kuangchao.platform.security.tokens import (
    DATASET_READ,
    ROLE_INTERFACES,
    Minter,
    Scope,
    check_devices,
    check_role,
    generate_key,
)
from kuangchao.platform.settings import Settings
from kuangchao.workers.data import corpus
from kuangchao.workers.data.corpus import load_corpus
from kuangchao.workers.data.prefetch import Prefetcher
from kuangchao.workers.runtime import telemetry
from kuangchao.workers.runtime.credentials import TokenHolder
from kuangchao.workers.runtime.telemetry import WorkerTelemetry
from kuangchao.workers.runtime.worker import TrainWorker
from tests.unit.authority_fakes import live_authority

SPEC = {"permission": {"collectives": ["all_reduce", "broadcast", "all_gather"],
                       "token_ttl_seconds": 600}}


def claims(role="trainer", devices=(), interfaces=("all_reduce",), key=None):
    key = key or generate_key()
    return Minter(key).mint("job-1/rank-0", "job-1", role, Scope(devices=tuple(devices)),
                            interfaces, 600)[1]


# -- device scope -----------------------------------------------------------------

def test_a_rank_takes_exactly_the_gpus_its_token_names():
    assert check_devices(claims(devices=(2, 3)), [3, 2]) == (2, 3)
    for wrong in ([2], [2, 3, 4], [0, 1], []):
        with pytest.raises(TokenError, match="may not use GPU") as info:
            check_devices(claims(devices=(2, 3)), wrong)
        assert info.value.reason == "denied" and "device scope is 2, 3" in info.value.message


def test_a_cpu_rank_takes_no_gpu_and_its_token_names_none():
    assert check_devices(claims(devices=()), []) == ()
    with pytest.raises(TokenError, match="GPU.s. 0; its token's device scope is none"):
        check_devices(claims(devices=()), [0])


def test_where_ray_picks_the_gpus_an_empty_scope_passes_but_a_named_one_must_match():
    # A node without per-GPU resources: the plan, so the token, names no GPU ids.
    assert check_devices(claims(devices=()), [1], planned=False) == (1,)
    assert check_devices(claims(devices=(1,)), [1], planned=False) == (1,)
    with pytest.raises(TokenError, match="denied"):
        check_devices(claims(devices=(1,)), [0], planned=False)


# -- role ceilings ----------------------------------------------------------------

@pytest.mark.parametrize("role", ["monitor", "data_loader"])
def test_a_monitor_or_data_loader_token_can_carry_no_collective_nor_checkpoint_write(role):
    assert not ROLE_INTERFACES[role] & (COLLECTIVES | {"checkpoint_write"})
    for iface in sorted(COLLECTIVES | {"checkpoint_write"}):
        with pytest.raises(ValueError, match="may not be granted"):
            claims(role=role, interfaces=(iface,))


def test_only_a_data_loader_reads_the_dataset_and_only_a_monitor_the_metrics():
    assert DATASET_READ in ROLE_INTERFACES["data_loader"]
    assert DATASET_READ not in ROLE_INTERFACES["trainer"] | ROLE_INTERFACES["monitor"]
    with pytest.raises(ValueError, match="may not be granted"):
        claims(role="trainer", interfaces=(DATASET_READ,))
    check_role(claims(role="data_loader", interfaces=(DATASET_READ,)), "data_loader", DATASET_READ)
    with pytest.raises(TokenError, match="holds a trainer token"):
        check_role(claims(role="trainer"), "data_loader", DATASET_READ)
    with pytest.raises(TokenError, match="may not call dataset_read"):
        check_role(claims(role="data_loader", interfaces=("heartbeat",)), "data_loader",
                   DATASET_READ)
    with pytest.raises(TokenError, match="holds a data_loader token"):
        check_role(claims(role="data_loader", interfaces=(DATASET_READ,)), "monitor",
                   "metrics_read")


# -- the grant --------------------------------------------------------------------

@pytest.fixture
def auth(tmp_path):
    return live_authority(tmp_path, SPEC)


def test_each_rank_gets_a_data_loader_and_a_monitor_token_with_its_trainer_token(auth):
    grants = auth.grant_workers("job-a", {0: (0,), 1: (1,)})
    for rank, grant in grants.items():
        assert set(grant.modules) == {"data_loader", "monitor"} == set(RANK_MODULES)
        assert grant.to_json()["modules"] == grant.modules
        trainer = auth.verify(grant.token)
        assert trainer.role == "trainer" and trainer.scope.devices == (rank,)
        assert DATASET_READ not in trainer.interfaces
        data = auth.verify(grant.modules["data_loader"])
        assert (data.module, data.role, data.interfaces) == (
            f"job-a/rank-{rank}/data", "data_loader", {DATASET_READ})
        mon = auth.verify(grant.modules["monitor"])
        assert (mon.module, mon.role, mon.interfaces) == (
            f"job-a/rank-{rank}/metrics", "monitor", {"metrics_read"})
        for c in (data, mon):  # no device, group, checkpoint or Redis prefix
            assert c.scope == Scope() and c.token_id in auth.store.issued_tokens("job-a")
    # Audited under the rank that holds them, each naming its module.
    mints = [r for r in auth.trail.read(job="job-a") if r["action"] == "token.mint"]
    assert len(mints) == 6 and {r["principal"] for r in mints} == {"job-a/rank-0", "job-a/rank-1"}
    assert any("module=job-a/rank-0/data role=data_loader" in r["reason"] for r in mints)


def test_the_module_tokens_renew_and_die_with_the_jobs(auth):
    grant = auth.grant_workers("job-a", {0: ()})[0]
    renewed = auth.renew(grant.modules["data_loader"])
    assert auth.verify(renewed).role == "data_loader"
    auth.revoke_job("job-a", "kill switch")
    for token in (renewed, grant.modules["monitor"], grant.token):
        with pytest.raises(TokenError, match="revoked"):
            auth.verify(token)


# -- in the rank ------------------------------------------------------------------

class Rank:
    """A token holder as a rank holds one, minted by a real authority."""

    def __init__(self, auth: TokenAuthority, modules=None, devices=(0,)) -> None:
        self.grant = auth.grant_workers("job-a", {0: devices})[0]
        self.denied: list[tuple[str, str, str]] = []
        mods = self.grant.modules if modules is None else modules
        self.holder = TokenHolder(self.grant.token, self.grant.public_key, auth.is_revoked,
                                  auth.renew, lambda *a: self.denied.append(a), modules=mods)


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "data.txt"
    path.write_bytes(b"hello tokens " * 20)
    return str(path)


def test_the_data_reader_reads_under_its_data_loader_token(auth, text):
    rank = Rank(auth)
    try:
        data = load_corpus(text, 1 << 20, 256)
        with Prefetcher(iter([data[:4]]), depth=1) as it:
            assert np.array_equal(next(it), data[:4])
        assert rank.denied == []
    finally:
        rank.holder.stop()
    assert corpus._read_guard is None  # stopped: the process reads unasked again


@pytest.mark.parametrize("which", ["none", "trainer", "revoked"])
def test_without_a_good_data_loader_token_nothing_is_read(auth, text, which):
    grant = auth.grant_workers("job-a", {0: ()})[0]
    modules = {"none": {}, "trainer": {"data_loader": grant.token},
               "revoked": dict(grant.modules)}[which]
    if which == "revoked":
        auth.revoke(auth.verify(grant.modules["data_loader"]).token_id, "test")
    rank = Rank(auth, modules=modules, devices=())
    try:
        with pytest.raises(PermissionError, match={"none": "holds no data_loader token",
                                                  "trainer": "holds a trainer token",
                                                  "revoked": "revoked"}[which]):
            load_corpus(text, 1 << 20, 256)
        with pytest.raises(PermissionError):
            Prefetcher(iter([1]), depth=1)
        assert [(i, r) for i, r, _ in rank.denied] == [(DATASET_READ, f"dataset/{text}"),
                                                       (DATASET_READ, "dataset/batches")]
    finally:
        rank.holder.stop()


def test_a_holder_without_modules_guards_no_reads(auth, text):
    grant = auth.grant_workers("job-a", {0: ()})[0]
    h = TokenHolder(grant.token, grant.public_key, auth.is_revoked, auth.renew, lambda *a: None)
    try:
        assert corpus._read_guard is None and load_corpus(text, 1 << 20, 256).size
    finally:
        h.stop()


def test_a_rank_refused_its_devices_says_so(auth):
    rank = Rank(auth, devices=(2,))
    try:
        assert rank.holder.check_devices([2]) == (2,)
        with pytest.raises(PermissionError, match="may not use GPU.s. 3"):
            rank.holder.check_devices([3])
        assert rank.denied[0][:2] == ("devices", "devices/3")
    finally:
        rank.holder.stop()


class _Report:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.report_denial = self
        self.renew = self

    def remote(self, *args):
        self.calls.append(args)


SETTINGS = Settings(redis_url=None, redis_prefix="kc-test:", ray_address=None,
                    api_url="http://127.0.0.1:0")


@pytest.mark.parametrize("with_monitor", [True, False])
def test_the_metrics_endpoint_starts_under_a_monitor_token(auth, monkeypatch, with_monitor):
    monkeypatch.setenv(telemetry.ADDR_ENV, "127.0.0.1")
    monkeypatch.setenv(telemetry.DISABLE_ENV, "1")
    # No socket in this tier: "serving" only sets the address.
    monkeypatch.setattr(WorkerTelemetry, "serve",
                        lambda self, host: setattr(self, "address", f"{host}:1") or self.address)
    grant = auth.grant_workers("job-a", {0: ()})[0].to_json()
    if not with_monitor:
        del grant["modules"]["monitor"]
    authority = _Report()
    worker = TrainWorker("job-a", 0, 1, SETTINGS, grant=grant, authority=authority)
    try:
        if with_monitor:
            assert worker.telemetry is not None and worker.telemetry.address
            assert authority.calls == []
        else:
            assert worker.telemetry is None
            ((token, iface, resource, reason),) = authority.calls
            assert (token, iface, resource) == (grant["token"], "metrics_read", "metrics/endpoint")
            assert "holds no monitor token" in reason
    finally:
        worker.shutdown()


class _RayContext:
    def __init__(self, assigned: dict[str, float]) -> None:
        self.assigned = assigned

    def get_assigned_resources(self) -> dict[str, float]:
        return self.assigned

    def get_node_id(self) -> str:
        return "node-1"


@pytest.mark.parametrize("scoped", [(1,), (0,)])
def test_a_rank_checks_its_device_scope_where_it_takes_its_gpus(auth, monkeypatch, scoped):
    # Ray as a rank sees it, faked: granted `kc_gpu_1`, Ray's own (logical) GPU id 0.
    fake = types.SimpleNamespace(get_gpu_ids=lambda: [0],
                                 get_runtime_context=lambda: _RayContext({"kc_gpu_1": 1.0}),
                                 util=types.SimpleNamespace(get_node_ip_address=lambda: "127.0.0.1"))
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setenv(telemetry.DISABLE_ENV, "0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "unset-by-the-test")
    grant = auth.grant_workers("job-a", {0: scoped})[0].to_json()  # planned: GPU 1
    authority = _Report()
    worker = TrainWorker("job-a", 0, 1, SETTINGS, planned_gpus=(1,), grant=grant,
                         authority=authority)
    try:
        if scoped == (1,):
            assert worker.describe()["gpu_ids"] == [1]
            assert authority.calls == [] and os.environ["CUDA_VISIBLE_DEVICES"] == "1"
        else:
            with pytest.raises(PermissionError, match="may not use GPU.s. 1; its token's device "
                                                      "scope is 0"):
                worker.describe()
            assert os.environ["CUDA_VISIBLE_DEVICES"] == "unset-by-the-test"
            assert [c[1:3] for c in authority.calls] == [("devices", "devices/1")]
    finally:
        worker.shutdown()
