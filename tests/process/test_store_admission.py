"""Bad object-store input refused at submission, against a real S3 server (moto's,
IAM enforced): an unknown scheme, a bucket that does not exist, missing or wrong
credentials. Each is a 422 naming `checkpoint.path` and what to change, and
nothing is queued or written to the store."""

from __future__ import annotations

import pytest

from kuangchao.platform.control import operations
from tests.s3server import S3Server

from ..unit.test_api_edge import SPEC, api  # noqa: F401 -- the fixture

BUCKET = "kc-admission"


@pytest.fixture(scope="module")
def s3():
    with S3Server(enforce_auth=True) as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture
def submit(api, s3, monkeypatch):  # noqa: F811
    store, client, _ = api
    s3.use_admin_env(monkeypatch)
    monkeypatch.setenv("KC_CHECKPOINT_URLS", f"s3://{BUCKET}, s3://missing-bucket")
    monkeypatch.setattr(operations, "_store_ok", {})  # no answer remembered from another test

    def post(path: str) -> tuple[int, str]:
        resp = client.post("/v1/jobs", json={**SPEC, "checkpoint": {"path": path}})
        return resp.status_code, resp.text

    yield post, store


def objects(s3: S3Server) -> list[str]:
    return [o["Key"] for o in s3.client().list_objects_v2(Bucket=BUCKET).get("Contents", [])]


def test_a_store_that_answers_admits_the_job(submit, s3):
    post, store = submit
    status, text = post(f"s3://{BUCKET}/ckpt")
    assert status == 201, text
    assert len(store.list()) == 1 and objects(s3) == []  # the ranks write; submission reads


def test_an_unknown_scheme_is_refused_at_validation(submit):
    post, store = submit
    status, text = post("nosuch://bucket/ckpt")
    assert status == 422 and "checkpoint.path" in text and "unknown URL scheme 'nosuch'" in text
    assert store.list() == []


def test_a_bucket_that_does_not_exist_is_refused(submit, s3):
    post, store = submit
    status, text = post("s3://missing-bucket/ckpt")
    assert status == 422 and "checkpoint.path" in text, text
    assert "bucket 'missing-bucket' does not exist" in text
    assert store.list() == [] and objects(s3) == []


def test_wrong_credentials_are_refused(submit, s3, monkeypatch):
    post, store = submit
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    status, text = post(f"s3://{BUCKET}/ckpt")
    assert status == 422 and "checkpoint.path" in text and "refused the credentials" in text, text
    assert store.list() == []


def test_missing_credentials_are_refused(submit, s3, monkeypatch):
    post, store = submit
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    status, text = post(f"s3://{BUCKET}/ckpt")
    assert status == 422 and "checkpoint.path" in text and "no credentials" in text, text
    assert store.list() == [] and objects(s3) == []
