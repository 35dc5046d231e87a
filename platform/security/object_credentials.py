"""Object-store credentials for one job: keys that reach only the job's own prefix.

The token authority holds the operator's credentials (the standard `AWS_*`
environment) and hands each job's ranks keys of their own: read, write, list and
delete under the job's prefix (`s3://bucket/prefix/<job>`: checkpoints, profiles),
read and list under its read URLs (`data.path`). `KC_OBJECT_STORE_CREDENTIALS`:

* `scoped` (default) with `KC_OBJECT_STORE_ROLE_ARN`: an STS AssumeRole session of
  that role narrowed by the prefix policy as its session policy (AWS, MinIO);
* `scoped` without it: a role of the job's own (`kc-job-<job>`, IAM path
  `/kuangchao/`) that trusts the operator's principal and holds the prefix policy
  inline, assumed with the same session policy. Stores that evaluate a role's
  policies but not session policies (moto, some Ceph RGW releases) enforce this
  one too. `release` deletes the role when the job ends;
* `shared`: the operator's own keys (scope "shared"), for stores without STS.

No Ray, Redis or torch; boto3 is imported only when a grant reaches the network.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from kuangchao.platform.errors import StorageError
from kuangchao.platform.storage import objects
from kuangchao.platform.storage.objects import S3_SCHEMES, StoreCredentials
from kuangchao.platform.storage.urls import ObjectUrl, parse

MODE_ENV = "KC_OBJECT_STORE_CREDENTIALS"
ROLE_ENV = "KC_OBJECT_STORE_ROLE_ARN"
MODES = ("scoped", "shared")
DEFAULT_DURATION_S = 12 * 3600
# STS's bounds on a session; a chained role (operator keys from a role) gets 1 h at most.
MIN_DURATION_S, MAX_DURATION_S, FALLBACK_DURATION_S = 900, 43200, 3600
RENEW_MARGIN_S = 30 * 60
ROLE_PREFIX = "kc-job-"
ROLE_PATH = "/kuangchao/"
ROLE_POLICY_NAME = "kc-job-prefix"
ROLE_PROPAGATION_S = 30.0  # AWS refuses to assume a new role for some seconds (IAM propagates)
OBJECT_WRITE_ACTIONS = ("s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload",
                        "s3:ListMultipartUploadParts")
OBJECT_READ_ACTIONS = ("s3:GetObject",)
IAM_NEEDS = ("iam:CreateRole, GetRole, UpdateAssumeRolePolicy, PutRolePolicy, ListRolePolicies, "
             "DeleteRolePolicy, ListAttachedRolePolicies, DeleteRole and sts:AssumeRole on "
             "arn:aws:iam::<account>:role/kuangchao/*")
ALTERNATIVES = (f"set {ROLE_ENV} to a role they may assume (a session policy then narrows it to "
                f"each job's prefix), or {MODE_ENV}=shared to give ranks the operator's own keys")


# -- pure decisions -------------------------------------------------------------------

def mode_from(value: str | None) -> str:
    """The credential mode `value` names (None or empty: `scoped`); StorageError if none."""
    mode = (value or "scoped").strip().lower()
    if mode not in MODES:
        raise StorageError(f"{MODE_ENV}={value!r} is not a credential mode; use one of "
                           f"{', '.join(MODES)}")
    return mode


def _safe_name(job_id: str, prefix: str, limit: int) -> str:
    """`prefix` + `job_id` in IAM's name alphabet within `limit` characters. A job id
    that had to be changed or cut, or has capitals (IAM names ignore case), gets a
    hash of itself so that two never collide."""
    clean = re.sub(r"[^A-Za-z0-9+=,.@_-]", "-", job_id)
    if clean == job_id.lower() and len(prefix) + len(clean) <= limit:
        return prefix + clean
    digest = hashlib.sha256(job_id.encode()).hexdigest()[:10]
    return f"{prefix}{clean[:limit - len(prefix) - len(digest) - 1]}-{digest}"


def role_name(job_id: str) -> str:
    """The IAM role of a job (64 characters at most, `[\\w+=,.@-]`), under ROLE_PATH."""
    return _safe_name(job_id, ROLE_PREFIX, 64)


def session_name(job_id: str) -> str:
    """The AssumeRole session name of a job: it shows in the store's access logs."""
    return _safe_name(job_id, "kc-", 64)


def partition(region: str | None) -> str:
    """The ARN partition of `region` (China and GovCloud have their own)."""
    region = region or ""
    return "aws-cn" if region.startswith("cn-") else "aws-us-gov" if region.startswith("us-gov-") else "aws"


def scoped_urls(write_url: str, read_urls: tuple[str, ...] = ()) -> tuple[ObjectUrl, tuple[ObjectUrl, ...]]:
    """`write_url` and `read_urls` parsed, each an S3 URL a policy can scope. StorageError
    for one that does not parse, of another scheme, with an IAM wildcard in its key, or
    a write URL that is a whole bucket."""
    out = []
    for url in (write_url, *read_urls):
        try:
            parsed = parse(url)
        except ValueError as exc:
            raise StorageError(str(exc)) from None
        if parsed.scheme not in S3_SCHEMES:
            raise StorageError(
                f"{parsed.scheme}:// credentials cannot be scoped to a job's prefix (only s3:// "
                f"can); set {MODE_ENV}=shared to give its ranks the operator's own credentials")
        if any(c in parsed.key for c in "*?$"):  # IAM would read them as wildcards/variables
            raise StorageError(f"{url}: a scoped prefix cannot hold '*', '?' or '$'; rename it")
        out.append(parsed)
    if not out[0].key:
        raise StorageError(f"{write_url} is a whole bucket; a job writes under a prefix (s3://bucket/prefix)")
    return out[0], tuple(out[1:])


def prefix_policy(write: ObjectUrl, reads: tuple[ObjectUrl, ...] = (), region: str | None = None) -> dict:
    """The IAM policy of a job: objects under `write` read, written and deleted,
    those under each of `reads` read, and each of those prefixes listed.

    Object actions cover `key/*` and the object `key` itself: s3fs asks HeadObject
    of a folder's own key (`exists`, `info`), which AWS answers 403, not 404, when
    the policy does not reach it; no other job's prefix can be that key.

    Listing is s3:ListBucket on the bucket under `StringLike s3:prefix [key/, key/*]`
    (a listing without a prefix, or of another, is refused): AWS, MinIO and Ceph
    evaluate it. moto ignores every condition operator but StringEquals, so there
    a job may list the names in the whole bucket (not read or write them); no shape
    without the condition narrows a listing anywhere, so it stays. A read URL that
    is a whole bucket lists it without one.
    """
    arn = f"arn:{partition(region)}:s3:::"
    statements: list[dict[str, Any]] = [{
        "Sid": "JobPrefixObjects", "Effect": "Allow", "Action": list(OBJECT_WRITE_ACTIONS),
        "Resource": [f"{arn}{write.bucket}/{write.key}", f"{arn}{write.bucket}/{write.key}/*"]}]
    read_resources: list[str] = []
    for url in reads:
        more = [f"{arn}{url.bucket}/{url.key}", f"{arn}{url.bucket}/{url.key}/*"] if url.key else [
            f"{arn}{url.bucket}/*"]
        read_resources += [r for r in more if r not in read_resources]
    if read_resources:
        statements.append({"Sid": "ReadObjects", "Effect": "Allow", "Action": list(OBJECT_READ_ACTIONS),
                           "Resource": read_resources})
    listed: dict[str, list[str] | None] = {}  # bucket -> its prefixes (None: all of it)
    for url in (write, *reads):
        prefixes = listed.setdefault(url.bucket, [])
        if prefixes is None or not url.key:
            listed[url.bucket] = None
        else:
            prefixes += [p for p in (f"{url.key}/", f"{url.key}/*") if p not in prefixes]
    for i, (bucket, prefixes) in enumerate(listed.items()):
        statement: dict[str, Any] = {"Sid": f"List{i}", "Effect": "Allow", "Action": "s3:ListBucket",
                                     "Resource": f"{arn}{bucket}"}
        if prefixes is not None:
            statement["Condition"] = {"StringLike": {"s3:prefix": prefixes}}
        statements.append(statement)
    return {"Version": "2012-10-17", "Statement": statements}


def policy_json(policy: dict) -> str:
    """Compact JSON: a session policy may hold 2048 characters at most."""
    return json.dumps(policy, separators=(",", ":"))


def trust_policy(principal_arn: str) -> dict:
    """A role only `principal_arn` (the operator) may assume."""
    return {"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Principal": {"AWS": principal_arn}, "Action": "sts:AssumeRole"}]}


def principal_of(caller_arn: str) -> tuple[str, str | None]:
    """What a trust policy names for the caller `caller_arn` (sts GetCallerIdentity):
    a user as it is; an assumed-role session as its role (name returned second, to
    look up the role's path), since a session's own name changes as it renews."""
    m = re.match(r"^arn:([\w-]+):sts::(\d+):assumed-role/([^/]+)/", caller_arn)
    return (f"arn:{m[1]}:iam::{m[2]}:role/{m[3]}", m[3]) if m else (caller_arn, None)


def renewal_due(credentials: StoreCredentials, now: float, margin_s: float = RENEW_MARGIN_S) -> bool:
    return credentials.expires_at is not None and now + margin_s >= credentials.expires_at


# -- the vendor --------------------------------------------------------------------------

class ObjectCredentialVendor:
    """Grants each job store credentials that reach its own prefix only (module doc).

    `mode` defaults to KC_OBJECT_STORE_CREDENTIALS, `role_arn` (the role a session
    policy narrows; without one, a role per job) to KC_OBJECT_STORE_ROLE_ARN;
    `duration_s` is clamped to STS's 15 min to 12 h; `clock` dates the cache.
    """

    def __init__(self, mode: str | None = None, role_arn: str | None = None,
                 duration_s: int = DEFAULT_DURATION_S, clock: Callable[[], float] = time.time) -> None:
        self.mode = mode_from(mode if mode is not None else os.environ.get(MODE_ENV))
        self.role_arn = (role_arn if role_arn is not None else os.environ.get(ROLE_ENV)) or None
        self.duration_s = int(min(max(duration_s, MIN_DURATION_S), MAX_DURATION_S))
        self.clock = clock
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[tuple[str, ...], StoreCredentials]] = {}

    def cached(self, job_id: str, urls: tuple[str, ...]) -> StoreCredentials | None:
        """The grant held for `job_id` on these URLs, unless it expires within 30 min."""
        with self._lock:
            held = self._cache.get(job_id)
        if held is None or held[0] != urls:
            return None
        margin = min(RENEW_MARGIN_S, self.duration_s / 2)
        return None if renewal_due(held[1], self.clock(), margin) else held[1]

    def grant(self, job_id: str, write_url: str, read_urls: tuple[str, ...] = ()) -> StoreCredentials:
        """Credentials for `job_id`'s ranks: `write_url` (the job's own prefix,
        `s3://bucket/prefix/<job>`) read-write, `read_urls` read-only.

        Raises:
            StorageError: A URL that cannot be scoped, or STS/IAM refused; the
                message says what to change.
        """
        urls = (write_url, *read_urls)
        held = self.cached(job_id, urls)
        if held is not None:
            return held
        if self.mode == "shared":
            credentials = self._shared()
        else:
            write, reads = scoped_urls(write_url, tuple(read_urls))
            policy = policy_json(prefix_policy(write, reads, objects.region_from_env()))
            credentials = self._assume(job_id, policy)
        with self._lock:
            self._cache[job_id] = (urls, credentials)
        return credentials

    def release(self, job_id: str) -> bool:
        """Forget `job_id`'s grant and delete its role; True when a role was deleted.
        Idempotent; a role of that name kuangchao did not make (another IAM path) is
        left alone. StorageError when IAM refuses."""
        with self._lock:
            self._cache.pop(job_id, None)
        if self.mode != "scoped" or self.role_arn:
            return False
        iam, name = self._client("iam"), role_name(job_id)
        try:
            if iam.get_role(RoleName=name)["Role"].get("Path") != ROLE_PATH:
                return False
            for policy in iam.list_role_policies(RoleName=name)["PolicyNames"]:
                iam.delete_role_policy(RoleName=name, PolicyName=policy)
            for policy in iam.list_attached_role_policies(RoleName=name)["AttachedPolicies"]:
                iam.detach_role_policy(RoleName=name, PolicyArn=policy["PolicyArn"])
            iam.delete_role(RoleName=name)
        except Exception as exc:  # botocore's ClientError, connection and credential errors
            if _code(exc) in ("NoSuchEntity", "NoSuchEntityException"):
                return False
            raise refusal(exc, "iam:DeleteRole") from None
        return True

    # -- the network --------------------------------------------------------------------

    def _client(self, service: str) -> Any:
        import boto3
        from botocore.config import Config

        region = objects.region_from_env()
        return boto3.session.Session().client(
            service, **({"region_name": region} if region else {}),
            config=Config(connect_timeout=5, read_timeout=15,
                          retries={"max_attempts": 3, "mode": "standard"}))

    def _shared(self) -> StoreCredentials:
        import boto3

        found = boto3.session.Session().get_credentials()
        if found is None:
            raise StorageError("no operator credentials for the object store; set AWS_ACCESS_KEY_ID "
                               "and AWS_SECRET_ACCESS_KEY (or a profile) where the token authority runs")
        frozen = found.get_frozen_credentials()
        expiry = getattr(found, "_expiry_time", None)  # refreshable keys (an instance role) expire
        return StoreCredentials(key=frozen.access_key, secret=frozen.secret_key, token=frozen.token,
                                expires_at=expiry.timestamp() if expiry is not None else None,
                                **_where(), scope="shared")

    def _assume(self, job_id: str, policy: str) -> StoreCredentials:
        doing = ["sts:AssumeRole"]  # the call under way, for the message if it fails
        try:
            sts = self._client("sts")
            arn = self.role_arn or self._ensure_role(job_id, policy, sts, doing)
            doing[0] = "sts:AssumeRole"
            # A role just made or updated: AWS may refuse it until IAM has propagated the change.
            fresh = not self.role_arn
            creds = self._assume_role(sts, arn, session_name(job_id), policy, fresh)["Credentials"]
        except StorageError:
            raise
        except Exception as exc:  # botocore's ClientError, connection and credential errors
            raise refusal(exc, doing[0], self.role_arn) from None
        return StoreCredentials(key=creds["AccessKeyId"], secret=creds["SecretAccessKey"],
                                token=creds["SessionToken"], expires_at=creds["Expiration"].timestamp(),
                                **_where(), scope="prefix")

    def _assume_role(self, sts: Any, arn: str, session: str, policy: str, fresh: bool) -> dict:
        from botocore.exceptions import ClientError

        duration, deadline, wait = self.duration_s, time.monotonic() + ROLE_PROPAGATION_S, 1.0
        while True:
            try:
                return sts.assume_role(RoleArn=arn, RoleSessionName=session, Policy=policy,
                                       DurationSeconds=duration)
            except ClientError as exc:
                text = str(exc)
                if (_code(exc) == "ValidationError" and duration > FALLBACK_DURATION_S
                        and ("DurationSeconds" in text or "MaxSessionDuration" in text)):
                    duration = FALLBACK_DURATION_S  # a role capped at 1 h, or a chained role
                    continue
                if fresh and _code(exc) == "AccessDenied" and time.monotonic() < deadline:
                    time.sleep(wait)  # IAM has not yet propagated the new role
                    wait = min(wait * 2, 8.0)
                    continue
                raise

    def _ensure_role(self, job_id: str, policy: str, sts: Any, doing: list[str]) -> str:
        """The ARN of the job's role, made or updated to hold the prefix policy."""
        from botocore.exceptions import ClientError

        iam, name = self._client("iam"), role_name(job_id)
        doing[0] = "sts:GetCallerIdentity"
        principal, caller_role = principal_of(sts.get_caller_identity()["Arn"])
        if caller_role is not None:  # the trust policy names the role with its path
            try:
                principal = iam.get_role(RoleName=caller_role)["Role"]["Arn"]
            except ClientError:
                pass
        trust = policy_json(trust_policy(principal))
        doing[0] = "iam:CreateRole"
        try:
            arn = iam.create_role(
                RoleName=name, Path=ROLE_PATH, AssumeRolePolicyDocument=trust,
                MaxSessionDuration=max(self.duration_s, FALLBACK_DURATION_S),
                Description="kuangchao: one job's own object-store prefix",
                Tags=[{"Key": "kuangchao-job", "Value": re.sub(r"[^\w.:/=+@ -]", "-", job_id)[:256]}],
            )["Role"]["Arn"]
        except ClientError as exc:
            if _code(exc) != "EntityAlreadyExists":
                raise
            # A re-grant (replacement ranks, a restarted authority): same role, today's trust.
            doing[0] = "iam:GetRole"
            role = iam.get_role(RoleName=name)["Role"]
            if role.get("Path") != ROLE_PATH:
                raise StorageError(f"an IAM role named {name} exists outside {ROLE_PATH}: kuangchao "
                                   "did not make it and will not take it over; delete or rename it") from None
            arn = role["Arn"]
            doing[0] = "iam:UpdateAssumeRolePolicy"
            iam.update_assume_role_policy(RoleName=name, PolicyDocument=trust)
        doing[0] = "iam:PutRolePolicy"
        iam.put_role_policy(RoleName=name, PolicyName=ROLE_POLICY_NAME, PolicyDocument=policy)
        return arn


def _where() -> dict[str, Any]:
    """The store's endpoint and region (not secret): they travel with the keys."""
    return {"endpoint_url": objects.endpoint_from_env(), "region": objects.region_from_env()}


def _code(exc: BaseException) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


def refusal(exc: BaseException, action: str, role_arn: str | None = None) -> StorageError:
    """An STS or IAM failure as a StorageError saying what to change."""
    code, text = _code(exc), " ".join(str(exc).split())[:300]
    name = type(exc).__name__
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return StorageError("no operator credentials to grant object-store access with; set AWS_ACCESS"
                            "_KEY_ID and AWS_SECRET_ACCESS_KEY (or a profile) where the authority runs")
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                "ConnectionClosedError"):
        return StorageError(f"STS/IAM cannot be reached for {action} ({text}); check AWS_ENDPOINT_URL "
                            "(or AWS_ENDPOINT_URL_STS / AWS_ENDPOINT_URL_IAM) and the network")
    if code in ("NotImplemented", "InvalidAction", "UnknownOperation", "MethodNotAllowed"):
        return StorageError(f"the object store has no IAM API for per-job roles ({action}: {text}); "
                            f"with MinIO, set {ROLE_ENV} (any role ARN: MinIO narrows the session "
                            f"by its policy), or {MODE_ENV}=shared")
    if code == "PackedPolicyTooLarge":
        return StorageError(f"the job's prefix policy is too large for an STS session ({text}); "
                            "name fewer or shorter data URLs")
    if code in ("InvalidClientTokenId", "SignatureDoesNotMatch", "InvalidAccessKeyId"):
        return StorageError(f"the store does not accept the operator's keys for {action} ({code}); "
                            "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY where the authority runs")
    if code in ("AccessDenied", "AccessDeniedException", "UnauthorizedOperation"):
        if action.startswith("iam:"):
            return StorageError(f"the operator's credentials may not {action} ({code}); give them "
                                f"{IAM_NEEDS}; or {ALTERNATIVES}")
        if role_arn:
            return StorageError(f"the operator's credentials may not assume {ROLE_ENV}={role_arn} "
                                f"({code}); allow them sts:AssumeRole on it and name them in its "
                                f"trust policy, or set {MODE_ENV}=shared")
        return StorageError(f"the operator's credentials may not assume the job's role ({code}: "
                            f"{text}); give them {IAM_NEEDS}; or {ALTERNATIVES}")
    return StorageError(f"{action} failed ({name} {code}: {text}); if the store cannot make per-job "
                        f"keys, {ALTERNATIVES}")
