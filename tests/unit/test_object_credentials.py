"""Per-job object-store credentials: the decisions, without a store.

The prefix policy a job's keys get, role and session names, the credential mode,
the grant cache with a fake clock, release's idempotence and the messages of
refusals, with fakes in place of STS and IAM (tests/process/test_object_credentials.py
runs the same against a real S3 server that enforces IAM).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from botocore.exceptions import ClientError, NoCredentialsError

from kuangchao.platform.errors import StorageError
from kuangchao.platform.security import object_credentials as oc
from kuangchao.platform.storage.objects import StoreCredentials
from kuangchao.platform.storage.urls import parse


def _statements(policy: dict) -> dict[str, dict]:
    return {s["Sid"]: s for s in policy["Statement"]}


def _error(code: str, op: str = "AssumeRole", message: str = "no") -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message}}, op)


# -- the policy -------------------------------------------------------------------------

def test_the_write_prefix_gets_object_actions_on_its_keys_and_a_conditioned_listing():
    policy = oc.prefix_policy(parse("s3://ckpt/runs/job-a"))
    st = _statements(policy)
    assert policy["Version"] == "2012-10-17"
    assert set(st) == {"JobPrefixObjects", "List0"}
    objects = st["JobPrefixObjects"]
    assert objects["Effect"] == "Allow"
    assert set(objects["Action"]) == {"s3:GetObject", "s3:PutObject", "s3:DeleteObject",
                                      "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"}
    assert objects["Resource"] == ["arn:aws:s3:::ckpt/runs/job-a", "arn:aws:s3:::ckpt/runs/job-a/*"]
    listing = st["List0"]
    assert listing["Action"] == "s3:ListBucket" and listing["Resource"] == "arn:aws:s3:::ckpt"
    assert listing["Condition"] == {"StringLike": {"s3:prefix": ["runs/job-a/", "runs/job-a/*"]}}


def test_read_urls_are_readable_and_listable_only():
    policy = oc.prefix_policy(parse("s3://ckpt/runs/job-a"),
                              (parse("s3://ckpt/shared/vocab"), parse("s3://data/sets/train")))
    st = _statements(policy)
    assert st["ReadObjects"]["Action"] == ["s3:GetObject"]
    assert st["ReadObjects"]["Resource"] == [
        "arn:aws:s3:::ckpt/shared/vocab", "arn:aws:s3:::ckpt/shared/vocab/*",
        "arn:aws:s3:::data/sets/train", "arn:aws:s3:::data/sets/train/*"]
    # one listing per bucket, with every prefix of that bucket
    assert st["List0"]["Resource"] == "arn:aws:s3:::ckpt"
    assert st["List0"]["Condition"]["StringLike"]["s3:prefix"] == [
        "runs/job-a/", "runs/job-a/*", "shared/vocab/", "shared/vocab/*"]
    assert st["List1"]["Resource"] == "arn:aws:s3:::data"
    assert st["List1"]["Condition"]["StringLike"]["s3:prefix"] == ["sets/train/", "sets/train/*"]
    # nothing but the job's own prefix may be written
    writable = [r for s in policy["Statement"] if "s3:PutObject" in s["Action"] for r in s["Resource"]]
    assert writable == ["arn:aws:s3:::ckpt/runs/job-a", "arn:aws:s3:::ckpt/runs/job-a/*"]


def test_a_whole_bucket_to_read_is_listed_without_a_condition():
    st = _statements(oc.prefix_policy(parse("s3://ckpt/runs/j"), (parse("s3://data"),)))
    assert st["ReadObjects"]["Resource"] == ["arn:aws:s3:::data/*"]
    assert "Condition" not in st["List1"]


def test_the_partition_follows_the_region():
    assert oc.partition(None) == "aws" and oc.partition("eu-west-1") == "aws"
    assert oc.partition("cn-north-1") == "aws-cn" and oc.partition("us-gov-west-1") == "aws-us-gov"
    st = _statements(oc.prefix_policy(parse("s3://b/p"), region="cn-north-1"))
    assert st["JobPrefixObjects"]["Resource"][0] == "arn:aws-cn:s3:::b/p"


def test_the_policy_json_is_compact_enough_for_a_session_policy():
    text = oc.policy_json(oc.prefix_policy(parse("s3://checkpoints/team/runs/llama-70b-sft-3f9a12cd"),
                                           (parse("s3://datasets/tokenized/pile-v2"),)))
    assert " " not in text and json.loads(text)["Statement"]
    assert len(text) < 2048  # STS's limit on a session policy


# -- which URLs can be scoped ---------------------------------------------------------------

def test_other_schemes_cannot_be_scoped_and_the_message_names_the_way_out():
    with pytest.raises(StorageError, match="KC_OBJECT_STORE_CREDENTIALS=shared") as err:
        oc.scoped_urls("gs://bucket/runs/a")
    assert "gs://" in err.value.message
    with pytest.raises(StorageError, match="cannot be scoped"):
        oc.scoped_urls("s3://bucket/runs/a", ("gs://data/train",))


def test_s3_and_s3a_urls_are_scoped():
    write, reads = oc.scoped_urls("s3a://bucket/runs/a", ("s3://data/train",))
    assert (write.scheme, write.bucket, write.key) == ("s3a", "bucket", "runs/a")
    assert reads == (parse("s3://data/train"),)


def test_a_whole_bucket_or_a_wildcard_cannot_be_a_jobs_prefix():
    with pytest.raises(StorageError, match="whole bucket"):
        oc.scoped_urls("s3://bucket")
    for bad in ("s3://bucket/runs/*", "s3://bucket/${aws:username}/a"):
        with pytest.raises(StorageError, match="cannot hold"):
            oc.scoped_urls(bad)
    with pytest.raises(StorageError):  # urls.parse refuses a `?` already
        oc.scoped_urls("s3://bucket/ru?s/a")
    with pytest.raises(StorageError, match="cannot hold"):
        oc.scoped_urls("s3://bucket/runs/a", ("s3://data/*",))
    with pytest.raises(StorageError):
        oc.scoped_urls("s3://bucket/runs/../other")


# -- names --------------------------------------------------------------------------------

def test_a_plain_job_id_names_its_role_and_session_as_it_is():
    assert oc.role_name("mnist-3f9a12cd") == "kc-job-mnist-3f9a12cd"
    assert oc.session_name("mnist-3f9a12cd") == "kc-mnist-3f9a12cd"


def test_changed_long_or_capitalised_ids_get_a_hash_and_never_collide():
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+=,.@_-")
    ids = ["a/b", "a:b", "a b", "x" * 80, "x" * 81, "Job-A", "job-a", "é"]
    names = [oc.role_name(i) for i in ids]
    assert len(set(n.lower() for n in names)) == len(ids)  # IAM role names ignore case
    for name in names + [oc.session_name(i) for i in ids]:
        assert len(name) <= 64 and set(name) <= allowed, name
    assert oc.role_name("a/b").startswith("kc-job-a-b-")


# -- the mode -------------------------------------------------------------------------------

def test_the_mode_defaults_to_scoped_and_reads_the_environment(monkeypatch):
    monkeypatch.delenv(oc.MODE_ENV, raising=False)
    monkeypatch.delenv(oc.ROLE_ENV, raising=False)
    vendor = oc.ObjectCredentialVendor()
    assert (vendor.mode, vendor.role_arn, vendor.duration_s) == ("scoped", None, 12 * 3600)
    monkeypatch.setenv(oc.MODE_ENV, "Shared")
    monkeypatch.setenv(oc.ROLE_ENV, "arn:aws:iam::1:role/kc")
    vendor = oc.ObjectCredentialVendor()
    assert (vendor.mode, vendor.role_arn) == ("shared", "arn:aws:iam::1:role/kc")
    assert oc.ObjectCredentialVendor(mode="scoped", role_arn="arn:x").mode == "scoped"


def test_an_unknown_mode_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv(oc.MODE_ENV, "open")
    with pytest.raises(StorageError, match="scoped, shared"):
        oc.ObjectCredentialVendor()


def test_the_duration_is_clamped_to_what_sts_grants():
    assert oc.ObjectCredentialVendor(mode="shared", duration_s=60).duration_s == 900
    assert oc.ObjectCredentialVendor(mode="shared", duration_s=10**6).duration_s == 43200


def test_an_unscopable_url_is_refused_before_any_network_call(monkeypatch):
    vendor = oc.ObjectCredentialVendor(mode="scoped")
    monkeypatch.setattr(vendor, "_client", lambda service: pytest.fail("reached the network"))
    with pytest.raises(StorageError, match="KC_OBJECT_STORE_CREDENTIALS=shared"):
        vendor.grant("j", "gs://b/runs/j")


# -- the cache ------------------------------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _counting_vendor(clock: FakeClock, duration_s: int = 3600):
    vendor = oc.ObjectCredentialVendor(mode="scoped", role_arn="arn:aws:iam::1:role/kc",
                                       duration_s=duration_s, clock=clock)
    minted: list[str] = []

    def assume(job_id: str, policy: str) -> StoreCredentials:
        minted.append(policy)
        return StoreCredentials(key=f"K{len(minted)}", secret="s", token="t",
                                expires_at=clock.now + vendor.duration_s)

    vendor._assume = assume  # type: ignore[method-assign]
    return vendor, minted


def test_a_second_grant_for_a_job_is_the_cached_one_until_it_nears_expiry():
    clock = FakeClock()
    vendor, minted = _counting_vendor(clock)
    first = vendor.grant("job-a", "s3://ckpt/runs/job-a", ("s3://data/train",))
    clock.now += 1799  # 30 min and a second before it expires
    assert vendor.grant("job-a", "s3://ckpt/runs/job-a", ("s3://data/train",)) is first
    clock.now += 2  # now within 30 min of expiry
    renewed = vendor.grant("job-a", "s3://ckpt/runs/job-a", ("s3://data/train",))
    assert renewed is not first and renewed.key == "K2" and len(minted) == 2


def test_the_cache_is_per_job_and_per_urls():
    clock = FakeClock()
    vendor, minted = _counting_vendor(clock, duration_s=12 * 3600)
    a = vendor.grant("job-a", "s3://ckpt/runs/job-a")
    b = vendor.grant("job-b", "s3://ckpt/runs/job-b")
    assert a.key != b.key
    assert vendor.grant("job-a", "s3://ckpt/runs/job-a", ("s3://data/x",)).key == "K3"
    assert "data/x" in minted[-1]
    assert vendor.cached("job-a", ("s3://ckpt/runs/job-a", "s3://data/x")) is not None


def test_a_short_duration_renews_at_half_its_life():
    clock = FakeClock()
    vendor, minted = _counting_vendor(clock, duration_s=900)
    first = vendor.grant("j", "s3://b/p/j")
    clock.now += 449
    assert vendor.grant("j", "s3://b/p/j") is first
    clock.now += 2
    assert vendor.grant("j", "s3://b/p/j") is not first


def test_shared_credentials_are_cached_and_released_without_iam(monkeypatch):
    vendor = oc.ObjectCredentialVendor(mode="shared", clock=FakeClock())
    calls = []
    monkeypatch.setattr(vendor, "_shared",
                        lambda: calls.append(1) or StoreCredentials("k", "s", scope="shared"))
    monkeypatch.setattr(vendor, "_client", lambda service: pytest.fail("shared mode reached IAM"))
    creds = vendor.grant("j", "gs://anything/at/all")  # shared: any scheme, no scoping
    assert creds.scope == "shared" and vendor.grant("j", "gs://anything/at/all") is creds
    assert vendor.release("j") is False
    vendor.grant("j", "gs://anything/at/all")
    assert len(calls) == 2


# -- release, with a fake IAM ------------------------------------------------------------------

class FakeIam:
    def __init__(self, roles: dict[str, str]) -> None:
        self.roles = dict(roles)  # name -> path
        self.calls: list[str] = []

    def get_role(self, RoleName):
        self.calls.append("get_role")
        if RoleName not in self.roles:
            raise _error("NoSuchEntity", "GetRole")
        return {"Role": {"Path": self.roles[RoleName], "Arn": f"arn:aws:iam::1:role{self.roles[RoleName]}"
                         f"{RoleName}"}}

    def list_role_policies(self, RoleName):
        return {"PolicyNames": [oc.ROLE_POLICY_NAME]}

    def delete_role_policy(self, RoleName, PolicyName):
        self.calls.append(f"delete_role_policy {PolicyName}")

    def list_attached_role_policies(self, RoleName):
        return {"AttachedPolicies": []}

    def delete_role(self, RoleName):
        self.calls.append("delete_role")
        del self.roles[RoleName]


def test_release_deletes_the_jobs_role_policy_first_and_is_idempotent(monkeypatch):
    iam = FakeIam({"kc-job-j": oc.ROLE_PATH})
    vendor = oc.ObjectCredentialVendor(mode="scoped", role_arn="")
    monkeypatch.setattr(vendor, "_client", lambda service: iam)
    assert vendor.release("j") is True
    assert iam.calls == ["get_role", f"delete_role_policy {oc.ROLE_POLICY_NAME}", "delete_role"]
    assert vendor.release("j") is False  # already gone: no error


def test_release_leaves_a_role_kuangchao_did_not_make(monkeypatch):
    iam = FakeIam({"kc-job-j": "/"})
    vendor = oc.ObjectCredentialVendor(mode="scoped", role_arn="")
    monkeypatch.setattr(vendor, "_client", lambda service: iam)
    assert vendor.release("j") is False and "kc-job-j" in iam.roles


def test_release_with_a_configured_role_deletes_nothing(monkeypatch):
    vendor = oc.ObjectCredentialVendor(mode="scoped", role_arn="arn:aws:iam::1:role/kc")
    monkeypatch.setattr(vendor, "_client", lambda service: pytest.fail("reached IAM"))
    assert vendor.release("j") is False


def test_a_refused_role_deletion_says_what_to_grant(monkeypatch):
    iam = FakeIam({"kc-job-j": oc.ROLE_PATH})
    iam.delete_role = lambda RoleName: (_ for _ in ()).throw(_error("AccessDenied", "DeleteRole"))
    vendor = oc.ObjectCredentialVendor(mode="scoped", role_arn="")
    monkeypatch.setattr(vendor, "_client", lambda service: iam)
    with pytest.raises(StorageError, match="iam:DeleteRole"):
        vendor.release("j")


# -- AssumeRole's retries, with a fake STS -----------------------------------------------------

class FakeSts:
    def __init__(self, failures: list[ClientError]) -> None:
        self.failures = failures
        self.durations: list[int] = []

    def assume_role(self, RoleArn, RoleSessionName, Policy, DurationSeconds):
        self.durations.append(DurationSeconds)
        if self.failures:
            raise self.failures.pop(0)
        return {"Credentials": {"AccessKeyId": "ASIA", "SecretAccessKey": "s", "SessionToken": "t",
                                "Expiration": datetime(2030, 1, 1, tzinfo=UTC)}}


def test_a_role_capped_at_an_hour_gets_an_hour():
    sts = FakeSts([_error("ValidationError", message="The requested DurationSeconds exceeds the "
                          "MaxSessionDuration set for this role.")])
    vendor = oc.ObjectCredentialVendor(mode="scoped", role_arn="arn:r")
    vendor._assume_role(sts, "arn:r", "kc-j", "{}", fresh=False)
    assert sts.durations == [43200, 3600]


def test_a_fresh_role_is_retried_while_iam_propagates_it(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(oc.time, "sleep", slept.append)
    sts = FakeSts([_error("AccessDenied"), _error("AccessDenied")])
    vendor = oc.ObjectCredentialVendor(mode="scoped", role_arn="")
    vendor._assume_role(sts, "arn:r", "kc-j", "{}", fresh=True)
    assert slept == [1.0, 2.0] and len(sts.durations) == 3


def test_an_old_role_that_refuses_is_not_retried(monkeypatch):
    monkeypatch.setattr(oc.time, "sleep", lambda s: pytest.fail("slept"))
    sts = FakeSts([_error("AccessDenied")])
    vendor = oc.ObjectCredentialVendor(mode="scoped", role_arn="arn:r")
    with pytest.raises(ClientError):
        vendor._assume_role(sts, "arn:r", "kc-j", "{}", fresh=False)


# -- trust and refusals -----------------------------------------------------------------------

def test_the_trust_policy_names_the_operator_and_a_session_becomes_its_role():
    assert oc.principal_of("arn:aws:iam::123456789012:user/ops/alice") == (
        "arn:aws:iam::123456789012:user/ops/alice", None)
    assert oc.principal_of("arn:aws:sts::123456789012:assumed-role/kc-head/i-0abc") == (
        "arn:aws:iam::123456789012:role/kc-head", "kc-head")
    trust = oc.trust_policy("arn:aws:iam::1:user/alice")
    assert trust["Statement"] == [{"Effect": "Allow", "Principal": {"AWS": "arn:aws:iam::1:user/alice"},
                                   "Action": "sts:AssumeRole"}]


def test_refusals_say_what_to_change():
    no_iam = oc.refusal(_error("AccessDenied", "CreateRole"), "iam:CreateRole").message
    assert "iam:CreateRole" in no_iam and oc.ROLE_ENV in no_iam and f"{oc.MODE_ENV}=shared" in no_iam
    no_role = oc.refusal(_error("AccessDenied"), "sts:AssumeRole", "arn:aws:iam::1:role/kc").message
    assert "KC_OBJECT_STORE_ROLE_ARN=arn:aws:iam::1:role/kc" in no_role and "trust policy" in no_role
    assert "AWS_ACCESS_KEY_ID" in oc.refusal(NoCredentialsError(), "sts:AssumeRole").message
    assert "AWS_SECRET_ACCESS_KEY" in oc.refusal(_error("InvalidClientTokenId"), "iam:CreateRole").message
    assert "fewer" in oc.refusal(_error("PackedPolicyTooLarge"), "sts:AssumeRole").message
    assert oc.MODE_ENV in oc.refusal(_error("NotImplemented", "CreateRole"), "iam:CreateRole").message
    other = oc.refusal(_error("Throttling"), "sts:AssumeRole").message
    assert "Throttling" in other and f"{oc.MODE_ENV}=shared" in other
