"""The token authority's object-store part (platform/security/storage_grants.py): which
jobs get credentials and for what, the audit of each decision, and release only for
jobs that named a store. The vendor (STS/IAM) is replaced by a recording fake."""

from __future__ import annotations

import pytest

from kuangchao.platform.errors import StorageError
from kuangchao.platform.security import storage_grants
from kuangchao.platform.spec.jobspec import validate_spec
from kuangchao.platform.storage.objects import StoreCredentials


class FakeVendor:
    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.granted: list[tuple[str, str, tuple[str, ...]]] = []
        self.released: list[str] = []

    def grant(self, job_id, write_url, read_urls=()):
        if self.refuse:
            raise StorageError("the store refused: set KC_OBJECT_STORE_ROLE_ARN")
        self.granted.append((job_id, write_url, tuple(read_urls)))
        return StoreCredentials("AK", "SK", "TOK", expires_at=1000.0)

    def release(self, job_id):
        self.released.append(job_id)
        return True


@pytest.fixture
def grants(monkeypatch):
    vendor = FakeVendor()
    monkeypatch.setattr(storage_grants, "ObjectCredentialVendor", lambda: vendor)
    audit: list[tuple] = []
    specs: dict[str, dict] = {}
    g = storage_grants.StorageGrants(lambda *a: audit.append(a), specs.get)
    return g, vendor, audit, specs


def spec(**sections):
    return validate_spec({"task": {"name": "t"}, **sections})


def test_a_store_job_gets_its_own_prefix_and_its_data_read_only(grants):
    g, vendor, audit, _ = grants
    out = g.grant("job-1", spec(checkpoint={"path": "s3://b/ckpt"},
                                data={"path": "s3://b/data/*.txt"}))
    assert StoreCredentials.from_json(out).key == "AK"
    assert vendor.granted == [("job-1", "s3://b/ckpt/job-1", ("s3://b/data",))]
    assert audit[-1][1:4] == ("storage.grant", "objects/s3://b/ckpt/job-1", "allow")
    assert "reads=s3://b/data" in audit[-1][4] and "AK" not in audit[-1][4]


def test_a_job_on_disk_gets_none_and_asks_no_store(grants):
    g, vendor, audit, _ = grants
    assert g.grant("job-2", spec(checkpoint={"path": "/tmp/ckpt"})) is None
    assert vendor.granted == [] and audit == []


def test_a_refusal_is_audited_and_raised(monkeypatch):
    monkeypatch.setattr(storage_grants, "ObjectCredentialVendor", lambda: FakeVendor(refuse=True))
    audit: list[tuple] = []
    g = storage_grants.StorageGrants(lambda *a: audit.append(a), lambda _j: None)
    with pytest.raises(StorageError, match="KC_OBJECT_STORE_ROLE_ARN"):
        g.grant("job-3", spec(checkpoint={"path": "s3://b/ckpt"}))
    assert audit[-1][3] == "deny"


def test_release_only_for_jobs_that_named_a_store(grants):
    g, vendor, audit, specs = grants
    specs["disk"] = {"checkpoint": {"path": "/tmp/c"}}
    specs["store"] = {"checkpoint": {"path": "s3://b/c"}}
    g.release("disk")
    g.release("gone")  # no record, nothing granted by this process
    assert vendor.released == []
    g.release("store")
    assert vendor.released == ["store"] and audit[-1][1:4] == (
        "storage.release", "objects/job/store", "allow")
