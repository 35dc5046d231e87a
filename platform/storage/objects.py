"""Opening an object store: the fsspec filesystem of a URL's scheme, with the
operator's credentials (the standard environment: `AWS_*`, `AWS_ENDPOINT_URL`
for MinIO or Ceph, `~/.aws/config`) or a job's scoped ones, and timeouts short
enough that a store that stops answering is noticed in seconds, not minutes.

Also the checks that turn a store's refusals into messages naming what to
change: an unknown scheme, a bucket that does not exist, missing or wrong
credentials.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from kuangchao.platform.errors import StorageError
from kuangchao.platform.storage.urls import ObjectUrl, parse

# botocore's waits: a connection in 5 s, each response in 15 s, and one retry of
# its own (s3fs's own retries are cut to one). A store frozen mid-request (SIGSTOP,
# a partition) then costs a request ~30 s before the uploader's own retry loop
# (mirror.py) takes over and says so.
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 15
S3_SCHEMES = frozenset({"s3", "s3a"})


@dataclass(frozen=True)
class StoreCredentials:
    """Credentials for one store, as the token authority hands them to a job's ranks.

    `endpoint_url` and `region` are not secret; they travel with the keys so that
    a rank needs nothing from the environment of its node.
    """

    key: str
    secret: str
    token: str | None = None
    expires_at: float | None = None
    endpoint_url: str | None = None
    region: str | None = None
    # What the keys may reach: "prefix" (scoped to the job's prefix by the store
    # itself) or "shared" (the operator's own keys, KC_OBJECT_STORE_CREDENTIALS=shared).
    scope: str = "prefix"

    def __repr__(self) -> str:  # never print a secret
        return (f"StoreCredentials(key={self.key[:4]}…, scope={self.scope}, "
                f"endpoint_url={self.endpoint_url}, expires_at={self.expires_at})")

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> StoreCredentials:
        return cls(**json.loads(text))

    def expired(self, margin_s: float = 0.0) -> bool:
        return self.expires_at is not None and time.time() + margin_s >= self.expires_at


def endpoint_from_env() -> str | None:
    """The operator's S3 endpoint (MinIO, Ceph, a local server), as botocore reads it."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def region_from_env() -> str | None:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None


def filesystem(scheme: str, credentials: StoreCredentials | None = None) -> Any:
    """A fresh fsspec filesystem for `scheme`.

    With `credentials`, those and nothing else (a rank never falls back to
    whatever its node's environment holds); without, the operator's from the
    standard environment. Listings are never cached: a checkpoint committed by
    another node must show at once.

    Raises:
        StorageError: An unknown scheme, or one whose package is not installed.
    """
    scheme = scheme.lower()
    if scheme in S3_SCHEMES:
        try:
            import s3fs
        except ImportError:
            raise StorageError("s3:// needs the s3fs package; install kuangchao with its "
                               "dependencies (pip install s3fs)") from None
        kw: dict[str, Any] = {
            "skip_instance_cache": True, "use_listings_cache": False,
            "config_kwargs": {"connect_timeout": CONNECT_TIMEOUT_S, "read_timeout": READ_TIMEOUT_S,
                              "retries": {"max_attempts": 2, "mode": "standard"}},
        }
        if credentials is not None:
            kw.update(key=credentials.key, secret=credentials.secret, token=credentials.token,
                      endpoint_url=credentials.endpoint_url)
            if credentials.region:
                kw["client_kwargs"] = {"region_name": credentials.region}
        else:
            endpoint = endpoint_from_env()
            if endpoint:
                kw["endpoint_url"] = endpoint
        kw["session"] = _session_without_expect_continue()
        fs = s3fs.S3FileSystem(**kw)
        # s3fs retries a timed-out call 5 times on top of botocore's attempts: a frozen
        # store would hold one request ~4 minutes. Once here; mirror.py's loop retries
        # with backoff and says so.
        fs.retries = 1
        return fs
    import fsspec

    try:
        cls = fsspec.get_filesystem_class(scheme)
    except ValueError:
        raise StorageError(unknown_scheme(scheme)) from None
    except ImportError as exc:
        raise StorageError(f"{scheme}:// needs a package that is not installed here: {exc}") from None
    return cls(skip_instance_cache=True)


def _session_without_expect_continue() -> Any:
    """An aiobotocore session whose S3 uploads send no `Expect: 100-continue`.

    botocore adds that header to every PutObject, and aiohttp then waits for the
    server's 100 Continue with no timeout at all: an upload to a store that stopped
    answering (frozen, partitioned) would hang forever instead of failing at
    READ_TIMEOUT_S. Without the header the body is simply sent.
    """
    import botocore.handlers
    from aiobotocore.session import AioSession

    session = AioSession()
    session.unregister("before-call.s3", botocore.handlers.add_expect_header)
    return session


def unknown_scheme(scheme: str) -> str:
    return (f"unknown URL scheme {scheme!r}; use a local path, s3://bucket/prefix, or another "
            "fsspec URL whose package is installed")


def check_scheme(url: str) -> str | None:
    """Why `url`'s scheme cannot be used here, or None. No network."""
    try:
        scheme = parse(url).scheme
    except ValueError as exc:
        return str(exc)
    if scheme in S3_SCHEMES:
        return None
    import fsspec

    if scheme not in fsspec.available_protocols():
        return unknown_scheme(scheme)
    try:
        fsspec.get_filesystem_class(scheme)
    except (ValueError, ImportError) as exc:
        return f"{scheme}:// needs a package that is not installed here: {exc}"
    return None


def describe_failure(exc: BaseException, url: ObjectUrl) -> str:
    """A store's refusal in words: which of bucket, credentials or reachability to fix."""
    text = f"{type(exc).__name__}: {exc}"
    low = text.lower()
    if "nosuchbucket" in low or "bucket does not exist" in low or (
            isinstance(exc, FileNotFoundError) and not url.key):
        return (f"bucket {url.bucket!r} does not exist at {url.scheme}://; create it, or name "
                "an existing bucket")
    if any(s in low for s in ("nocredentials", "unable to locate credentials",
                              "partialcredentials")):
        return ("no credentials for the object store; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or a profile) where the API and the controller run")
    if any(s in low for s in ("invalidaccesskeyid", "signaturedoesnotmatch", "invalidtoken",
                              "expiredtoken", "accessdenied", "access denied", "forbidden",
                              "permissionerror")) or isinstance(exc, PermissionError):
        return (f"the object store refused the credentials for {url}: {short(text)}; check "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY and the policy on that prefix")
    if any(s in low for s in ("connect", "timeout", "timed out", "endpoint")):
        return (f"the object store for {url} cannot be reached: {short(text)}; check "
                "AWS_ENDPOINT_URL and the network")
    return f"the object store refused {url}: {short(text)}"


def short(text: str, limit: int = 240) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "…"


def probe(url: str, credentials: StoreCredentials | None = None) -> str | None:
    """Why `url` cannot hold checkpoints, or None: the scheme is known, the bucket
    exists and the credentials may list it. Reads only; writes nothing."""
    problem = check_scheme(url)
    if problem is not None:
        return problem
    target = parse(url)
    try:
        fs = filesystem(target.scheme, credentials)
        fs.ls(target.bucket, detail=False) if not target.key else fs.ls(target.path, detail=False)
    except FileNotFoundError as exc:
        if target.key:  # an empty prefix under an existing bucket is fine: check the bucket
            try:
                fs.ls(target.bucket, detail=False)
                return None
            except Exception as inner:  # the store's own error types vary by scheme
                return describe_failure(inner, ObjectUrl(target.scheme, target.bucket))
        return describe_failure(exc, target)
    except StorageError as exc:
        return exc.message
    except Exception as exc:  # botocore, aiohttp and fsspec raise many kinds
        return describe_failure(exc, target)
    return None
