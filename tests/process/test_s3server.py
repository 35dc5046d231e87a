"""tests/s3server.py: the moto server the object-storage tests and benches use.

It starts and answers, holds objects written through kuangchao's own filesystem
(`platform.storage.objects.filesystem`) with the operator's environment from
`admin_env()`, stops answering while frozen and answers again once thawed, and
with `enforce_auth` refuses keys it does not know.
"""

from __future__ import annotations

import os
import time

import pytest
from botocore.exceptions import ClientError, ConnectTimeoutError, ReadTimeoutError

from kuangchao.platform.storage.objects import filesystem
from tests.s3server import S3Server

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        yield server


def test_objects_round_trip_through_kuangchaos_filesystem(s3, monkeypatch):
    s3.create_bucket("kc-roundtrip")
    s3.use_admin_env(monkeypatch)
    fs = filesystem("s3")
    fs.pipe("kc-roundtrip/run/a.bin", b"\x00weights\xff")
    assert fs.cat("kc-roundtrip/run/a.bin") == b"\x00weights\xff"
    assert fs.ls("kc-roundtrip/run", detail=False) == ["kc-roundtrip/run/a.bin"]
    fs.rm("kc-roundtrip/run/a.bin")
    assert not filesystem("s3").exists("kc-roundtrip/run/a.bin")


def test_a_frozen_server_times_requests_out_and_a_thawed_one_answers_again(s3, monkeypatch):
    s3.create_bucket("kc-freeze")
    s3.use_admin_env(monkeypatch)
    filesystem("s3").pipe("kc-freeze/k", b"v")
    # A client with short waits of its own: kuangchao's filesystem waits longer
    # (s3fs retries timeouts), and what is tested here is the server, not it.
    client = s3.client("s3", timeout_s=2, attempts=1)
    with s3.frozen():
        start = time.monotonic()
        with pytest.raises((ReadTimeoutError, ConnectTimeoutError)):
            client.get_object(Bucket="kc-freeze", Key="k")
        assert time.monotonic() - start < 30
    assert filesystem("s3").cat("kc-freeze/k") == b"v"
    assert os.getpgid(s3.pid) == s3.pid  # its own process group: freeze() stops it alone


def test_enforced_auth_refuses_unknown_keys_and_admits_the_admin(monkeypatch):
    with S3Server(enforce_auth=True) as s3:
        s3.create_bucket("kc-auth")
        with pytest.raises(ClientError) as refused:
            s3.client("s3", key="AKIAUNKNOWN0000000000", secret="nope").list_objects_v2(Bucket="kc-auth")
        assert refused.value.response["Error"]["Code"] in ("InvalidAccessKeyId", "AccessDenied")
        s3.use_admin_env(monkeypatch)
        fs = filesystem("s3")
        fs.pipe("kc-auth/x", b"1")
        assert fs.cat("kc-auth/x") == b"1"
    with pytest.raises(ProcessLookupError):
        os.kill(s3.pid, 0)
