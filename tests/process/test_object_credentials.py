"""Per-job object-store credentials against a real S3 server that enforces IAM (moto).

The token authority's vendor, run with the operator's (admin) keys, grants job A
keys of its own; through kuangchao's filesystem those keys read, write, list and
delete under A's prefix and read A's data, and are refused everywhere else: job
B's prefix, a sibling whose name starts like A's, the bucket root, another
bucket, writes to the data. `release` deletes A's role.

What moto does not enforce, and so is not asserted here (real AWS, MinIO and Ceph
do): the `s3:prefix` condition on listings (moto ignores conditions other than
StringEquals: a job may list other prefixes' names, never read them), and
session policies (KC_OBJECT_STORE_ROLE_ARN mode narrows by one alone).
"""

from __future__ import annotations

import json

import pytest
from botocore.exceptions import ClientError

from kuangchao.platform.errors import StorageError
from kuangchao.platform.security.object_credentials import (
    ROLE_PATH,
    ROLE_POLICY_NAME,
    ObjectCredentialVendor,
    prefix_policy,
    role_name,
)
from kuangchao.platform.storage.objects import filesystem
from kuangchao.platform.storage.urls import parse
from tests.s3server import S3Server

pytestmark = pytest.mark.timeout(180)

CKPT, DATA = "kc-ckpt", "kc-data"
A_URL, B_URL = f"s3://{CKPT}/runs/job-a", f"s3://{CKPT}/runs/job-b"
DATA_URL = f"s3://{DATA}/sets/train"


@pytest.fixture(scope="module")
def s3():
    with S3Server(enforce_auth=True) as server, pytest.MonkeyPatch.context() as mp:
        server.use_admin_env(mp)
        for bucket in (CKPT, DATA):
            server.create_bucket(bucket)
        admin = filesystem("s3")
        admin.pipe(f"{DATA}/sets/train/shard-0.bin", b"tokens")
        admin.pipe(f"{CKPT}/runs/job-b/step-1/model.pt", b"b's weights")
        admin.pipe(f"{CKPT}/runs/job-a2/step-1/model.pt", b"a2's weights")
        admin.pipe(f"{CKPT}/top-level.txt", b"root")
        yield server


@pytest.fixture(scope="module")
def granted(s3):
    vendor = ObjectCredentialVendor(mode="scoped", role_arn="")
    creds = vendor.grant("job-a", A_URL, (DATA_URL,))
    yield vendor, creds
    vendor.release("job-a")


def _refused(action) -> None:
    with pytest.raises((PermissionError, ClientError)) as err:
        action()
    if isinstance(err.value, ClientError):
        assert err.value.response["Error"]["Code"] in ("AccessDenied", "403"), err.value


def test_the_grant_is_prefix_scoped_temporary_and_carries_the_endpoint(s3, granted):
    _, creds = granted
    assert creds.scope == "prefix" and creds.token and creds.expires_at
    assert creds.key != s3.admin_env()["AWS_ACCESS_KEY_ID"]
    assert (creds.endpoint_url, creds.region) == (s3.endpoint, "us-east-1")
    iam = s3.client("iam")
    role = iam.get_role(RoleName=role_name("job-a"))["Role"]
    assert role["Path"] == ROLE_PATH
    doc = iam.get_role_policy(RoleName=role_name("job-a"), PolicyName=ROLE_POLICY_NAME)["PolicyDocument"]
    doc = json.loads(doc) if isinstance(doc, str) else doc
    assert doc == prefix_policy(parse(A_URL), (parse(DATA_URL),), "us-east-1")


def test_a_jobs_keys_read_write_list_and_delete_under_its_prefix(granted):
    fs = filesystem("s3", granted[1])
    fs.pipe(f"{CKPT}/runs/job-a/step-1/model.pt", b"a's weights")
    fs.pipe(f"{CKPT}/runs/job-a/step-1/optim.pt", b"a's optimizer")
    assert fs.cat(f"{CKPT}/runs/job-a/step-1/model.pt") == b"a's weights"
    assert fs.ls(f"{CKPT}/runs/job-a", detail=False) == [f"{CKPT}/runs/job-a/step-1"]
    assert sorted(fs.find(f"{CKPT}/runs/job-a")) == [f"{CKPT}/runs/job-a/step-1/model.pt",
                                                       f"{CKPT}/runs/job-a/step-1/optim.pt"]
    assert fs.exists(f"{CKPT}/runs/job-a") and fs.isdir(f"{CKPT}/runs/job-a/step-1")
    assert fs.info(f"{CKPT}/runs/job-a/step-1/model.pt")["size"] == len(b"a's weights")
    fs.rm_file(f"{CKPT}/runs/job-a/step-1/optim.pt")
    assert not fs.exists(f"{CKPT}/runs/job-a/step-1/optim.pt")


def test_a_multipart_upload_under_the_prefix_succeeds(granted):
    fs = filesystem("s3", granted[1])
    blob = bytes(range(256)) * (6 * 4096)  # 6 MiB: two parts of 5 MiB blocks
    with fs.open(f"{CKPT}/runs/job-a/big.bin", "wb", block_size=5 * 2**20) as f:
        f.write(blob)
    assert fs.cat(f"{CKPT}/runs/job-a/big.bin") == blob
    fs.rm_file(f"{CKPT}/runs/job-a/big.bin")


def test_a_jobs_keys_reach_nothing_outside_its_prefix(granted):
    fs = filesystem("s3", granted[1])
    _refused(lambda: fs.pipe(f"{CKPT}/runs/job-b/step-2/model.pt", b"overwrite"))
    _refused(lambda: fs.cat(f"{CKPT}/runs/job-b/step-1/model.pt"))
    _refused(lambda: fs.rm_file(f"{CKPT}/runs/job-b/step-1/model.pt"))
    # a sibling whose name starts like the job's own: `runs/job-a*` would have matched it
    _refused(lambda: fs.cat(f"{CKPT}/runs/job-a2/step-1/model.pt"))
    _refused(lambda: fs.pipe(f"{CKPT}/runs/job-a2/x", b"1"))
    _refused(lambda: fs.pipe(f"{CKPT}/runs/job-a-suffix", b"1"))
    _refused(lambda: fs.pipe(f"{CKPT}/top-level.txt", b"overwrite"))
    _refused(lambda: fs.cat(f"{CKPT}/top-level.txt"))
    _refused(lambda: fs.pipe(f"{DATA}/runs/job-a/x", b"1"))  # the same prefix in another bucket
    admin = filesystem("s3")
    assert admin.cat(f"{CKPT}/runs/job-b/step-1/model.pt") == b"b's weights"
    assert admin.cat(f"{CKPT}/top-level.txt") == b"root"
    assert not admin.exists(f"{CKPT}/runs/job-a2/x")


def test_the_data_url_is_readable_and_not_writable(granted):
    fs = filesystem("s3", granted[1])
    assert fs.cat(f"{DATA}/sets/train/shard-0.bin") == b"tokens"
    assert fs.ls(f"{DATA}/sets/train", detail=False) == [f"{DATA}/sets/train/shard-0.bin"]
    _refused(lambda: fs.pipe(f"{DATA}/sets/train/shard-1.bin", b"poison"))
    _refused(lambda: fs.rm_file(f"{DATA}/sets/train/shard-0.bin"))
    assert filesystem("s3").cat(f"{DATA}/sets/train/shard-0.bin") == b"tokens"


def test_a_regrant_reuses_the_cache_and_a_fresh_authority_reuses_the_role(granted):
    vendor, creds = granted
    assert vendor.grant("job-a", A_URL, (DATA_URL,)) is creds
    again = ObjectCredentialVendor(mode="scoped").grant("job-a", A_URL, (DATA_URL,))  # role exists
    assert again.key != creds.key
    fs = filesystem("s3", again)
    fs.pipe(f"{CKPT}/runs/job-a/from-replacement", b"1")
    _refused(lambda: fs.cat(f"{CKPT}/runs/job-b/step-1/model.pt"))


def test_release_deletes_the_role_and_a_later_grant_makes_a_new_one(s3):
    vendor = ObjectCredentialVendor(mode="scoped")
    creds = vendor.grant("job-c", f"s3://{CKPT}/runs/job-c")
    filesystem("s3", creds).pipe(f"{CKPT}/runs/job-c/x", b"1")
    assert vendor.release("job-c") is True
    with pytest.raises(ClientError, match="NoSuchEntity"):
        s3.client("iam").get_role(RoleName=role_name("job-c"))
    assert vendor.release("job-c") is False  # idempotent
    with pytest.raises(OSError):  # the released keys are refused (moto: a 500; AWS: 403)
        filesystem("s3", creds).pipe(f"{CKPT}/runs/job-c/y", b"1")
    assert filesystem("s3").cat(f"{CKPT}/runs/job-c/x") == b"1"  # the operator is unaffected
    fresh = vendor.grant("job-c", f"s3://{CKPT}/runs/job-c")
    filesystem("s3", fresh).pipe(f"{CKPT}/runs/job-c/y", b"2")
    vendor.release("job-c")


def test_shared_mode_hands_out_the_operators_own_keys(s3):
    creds = ObjectCredentialVendor(mode="shared").grant("job-a", A_URL, (DATA_URL,))
    assert creds.scope == "shared" and creds.key == s3.admin_env()["AWS_ACCESS_KEY_ID"]
    assert filesystem("s3", creds).cat(f"{CKPT}/top-level.txt") == b"root"


def test_operator_keys_without_iam_rights_get_a_message_naming_the_alternatives(s3, monkeypatch):
    iam = s3.client("iam")
    iam.create_user(UserName="s3-only")
    iam.put_user_policy(UserName="s3-only", PolicyName="s3", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
    key = iam.create_access_key(UserName="s3-only")["AccessKey"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    with pytest.raises(StorageError) as err:
        ObjectCredentialVendor(mode="scoped").grant("job-d", f"s3://{CKPT}/runs/job-d")
    assert "iam:CreateRole" in err.value.message
    assert "KC_OBJECT_STORE_ROLE_ARN" in err.value.message
    assert "KC_OBJECT_STORE_CREDENTIALS=shared" in err.value.message


def test_a_configured_role_is_assumed_with_the_prefix_session_policy(s3):
    iam = s3.client("iam")
    admin_arn = s3.client("sts").get_caller_identity()["Arn"]
    arn = iam.create_role(RoleName="kc-ranks", AssumeRolePolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {"AWS": admin_arn},
                                                "Action": "sts:AssumeRole"}]}))["Role"]["Arn"]
    iam.put_role_policy(RoleName="kc-ranks", PolicyName="s3", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
    vendor = ObjectCredentialVendor(mode="scoped", role_arn=arn)
    creds = vendor.grant("job-e", f"s3://{CKPT}/runs/job-e")
    assert creds.scope == "prefix" and creds.token
    filesystem("s3", creds).pipe(f"{CKPT}/runs/job-e/x", b"1")
    # moto does not apply the session policy: job-e's keys reach beyond its prefix there
    assert vendor.release("job-e") is False
    iam.get_role(RoleName="kc-ranks")  # a configured role is never deleted
