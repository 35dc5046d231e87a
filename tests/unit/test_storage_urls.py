"""Object-store URLs (platform/storage/urls.py) and the capability tokens' prefix rules
for them (platform/security/tokens.py): telling a URL from a path, normalising it,
refusing every spelling that would leave a prefix."""

from __future__ import annotations

import pytest

from kuangchao.platform.errors import TokenError
from kuangchao.platform.security.tokens import within_prefix, within_url_prefix
from kuangchao.platform.storage.urls import (
    ObjectUrl,
    check_part,
    is_url,
    parse,
    relative,
    step_key,
    under_prefixes,
)

# -- is_url ---------------------------------------------------------------------------


@pytest.mark.parametrize("location", ["s3://bucket/ckpt", "S3://bucket", "gs://b/x", "memory://b",
                                      "s3a://b/k", "abfs+x.y-z://b/k"])
def test_remote_schemes_are_urls(location):
    assert is_url(location)


@pytest.mark.parametrize("location", ["/abs/ckpt", "ckpt", "runs/a:b", "C:\\ckpt", "file:///tmp/x",
                                      "FILE:///tmp/x", "local://ckpt", "", "://b/x", "1s3://b/x",
                                      "s3:/b/x", "s3:b/x"])
def test_paths_and_local_schemes_are_not_urls(location):
    assert not is_url(location)


# -- parse ----------------------------------------------------------------------------


@pytest.mark.parametrize("url, scheme, bucket, key", [
    ("s3://bucket/a/b", "s3", "bucket", "a/b"),
    ("S3://bucket/a/b/", "s3", "bucket", "a/b"),  # the scheme lowercased, a trailing / dropped
    ("s3://bucket", "s3", "bucket", ""),
    ("s3://bucket/", "s3", "bucket", ""),
    ("s3://bucket/a//", "s3", "bucket", "a"),
    ("gs://Bucket/Key", "gs", "Bucket", "Key"),  # bucket and key keep their case
    ("s3://b/..a/b..", "s3", "b", "..a/b.."),  # dots inside a name are plain characters
])
def test_parse_normalises_a_url(url, scheme, bucket, key):
    parsed = parse(url)
    assert (parsed.scheme, parsed.bucket, parsed.key) == (scheme, bucket, key)
    assert parse(str(parsed)) == parsed  # its text parses back to itself


@pytest.mark.parametrize("url", ["s3://b/a/../c", "s3://b/..", "s3://b/a/..", "s3://b/./a",
                                 "s3://b/a/.", "s3://b//a", "s3://b/a//c"])
def test_parse_refuses_dot_and_empty_segments(url):
    with pytest.raises(ValueError, match="empty, '.' or '..' segment"):
        parse(url)


@pytest.mark.parametrize("url", ["s3://b/a?versionId=1", "s3://b/a#frag", "s3://b/a\\..\\c",
                                 "s3://b\\x/a", "s3://b/a\0b"])
def test_parse_refuses_queries_fragments_backslashes_and_nul(url):
    with pytest.raises(ValueError, match="no query, fragment, backslash"):
        parse(url)


@pytest.mark.parametrize("url", ["s3://", "s3:///a/b"])
def test_parse_refuses_a_url_without_a_bucket(url):
    with pytest.raises(ValueError, match="names no bucket"):
        parse(url)


@pytest.mark.parametrize("url", ["/tmp/ckpt", "ckpt", "file:///tmp/ckpt", "local://x", ""])
def test_parse_refuses_what_is_not_an_object_store_url(url):
    with pytest.raises(ValueError, match="is not an object-store URL"):
        parse(url)


# -- ObjectUrl ------------------------------------------------------------------------


def test_object_url_text_and_fsspec_path():
    url = parse("s3://bucket/ckpt/job-1")
    assert str(url) == "s3://bucket/ckpt/job-1" and url.path == "bucket/ckpt/job-1"
    bare = parse("s3://bucket")
    assert str(bare) == "s3://bucket" and bare.path == "bucket"


def test_join_appends_plain_parts_and_refuses_any_other():
    url = parse("s3://bucket/ckpt")
    assert url.join("job-1", "step_00000001") == ObjectUrl("s3", "bucket", "ckpt/job-1/step_00000001")
    assert parse("s3://bucket").join("job-1") == ObjectUrl("s3", "bucket", "job-1")
    assert step_key(url, "manifest.json").path == "bucket/ckpt/manifest.json"
    for bad in ("", ".", "..", "a/b", "/abs", "x\0y"):
        with pytest.raises(ValueError, match="not a plain object-key segment"):
            url.join("job-1", bad)


def test_check_part_accepts_names_with_dots_and_refuses_escapes():
    for ok in ("step_00000001", ".metadata", "..a", "__0_0.distcp", "a..b"):
        check_part(ok)
    for bad in ("", ".", "..", "a/b", "../x", "x\0"):
        with pytest.raises(ValueError):
            check_part(bad)


def test_contains_is_segment_wise_and_per_bucket_and_scheme():
    ckpt = parse("s3://b/ckpt")
    assert ckpt.contains(parse("s3://b/ckpt"))
    assert ckpt.contains(parse("s3://b/ckpt/job-1/step_1"))
    assert not ckpt.contains(parse("s3://b/ckpt2/x"))  # a sibling that starts alike
    assert not ckpt.contains(parse("s3://b/ckp"))
    assert not ckpt.contains(parse("s3://b"))  # the parent
    assert not ckpt.contains(parse("s3://other/ckpt/x"))
    assert not ckpt.contains(parse("gs://b/ckpt/x"))
    assert parse("s3://b").contains(parse("s3://b/anything/below"))
    assert not parse("s3://b").contains(parse("s3://bb/x"))


def test_relative_is_the_key_below_the_base():
    assert relative(parse("s3://b/ckpt"), parse("s3://b/ckpt/job/step_1")) == "job/step_1"
    assert relative(parse("s3://b"), parse("s3://b/job/x")) == "job/x"
    with pytest.raises(ValueError, match="is not inside"):
        relative(parse("s3://b/ckpt"), parse("s3://b/ckpt2/x"))


# -- under_prefixes -------------------------------------------------------------------


def test_under_prefixes_holds_a_url_to_its_prefixes_segment_wise():
    prefixes = ("s3://b/ckpt", "gs://other/runs/")
    assert under_prefixes("s3://b/ckpt", prefixes)
    assert under_prefixes("s3://b/ckpt/job-1", prefixes)
    assert under_prefixes("S3://b/ckpt/job-1/", prefixes)
    assert under_prefixes("gs://other/runs/x", prefixes)
    assert not under_prefixes("s3://b/ckpt2/x", prefixes)
    assert not under_prefixes("s3://b/ckpt-other", prefixes)
    assert not under_prefixes("s3://b", prefixes)
    assert not under_prefixes("s3://c/ckpt/x", prefixes)
    assert not under_prefixes("gs://b/ckpt/x", prefixes)
    assert not under_prefixes("s3://b/ckpt/../secrets", prefixes)  # unparseable: refused
    assert not under_prefixes("s3://b/ckpt/job?x=1", prefixes)
    assert not under_prefixes("/local/ckpt", prefixes)
    assert not under_prefixes("s3://b/ckpt/x", ())


def test_under_prefixes_skips_a_malformed_prefix_and_checks_the_rest():
    assert under_prefixes("s3://b/ckpt/x", ("s3://b/../ckpt", "not a url", "s3://b/ckpt"))
    assert not under_prefixes("s3://b/ckpt/x", ("s3://b/../ckpt", "/local"))


# -- capability tokens ----------------------------------------------------------------


def denied(fn) -> str:
    with pytest.raises(TokenError) as info:
        fn()
    assert info.value.reason == "denied"
    return info.value.message


JOB = "s3://bucket/ckpt/job-a"


def test_a_url_inside_the_jobs_prefix_is_granted_normalised():
    assert within_url_prefix(JOB, "s3://bucket/ckpt/job-a/step_00000001/") == \
        "s3://bucket/ckpt/job-a/step_00000001"
    assert within_url_prefix(JOB, "S3://bucket/ckpt/job-a") == JOB
    assert within_url_prefix(JOB + "/", JOB + "/x") == JOB + "/x"
    within_prefix(JOB, JOB + "/step_1")  # granted (its return is a PurePosixPath, not for URLs)


@pytest.mark.parametrize("url", [
    "s3://bucket/ckpt/job-b/step_1",  # another job's prefix
    "s3://bucket/ckpt/job-a2/step_1",  # a sibling whose name starts like the job's
    "s3://bucket/ckpt",  # the parent
    "s3://other/ckpt/job-a/step_1",  # another bucket
    "gs://bucket/ckpt/job-a/step_1",  # another store
])
def test_a_url_outside_the_jobs_prefix_is_denied(url):
    assert "is outside" in denied(lambda: within_url_prefix(JOB, url))
    denied(lambda: within_prefix(JOB, url))


@pytest.mark.parametrize("url", [
    "s3://bucket/ckpt/job-a/../job-b",
    "s3://bucket/ckpt/job-a/../../ckpt/job-b/step_1",
    "s3://bucket/ckpt/job-a/./step_1",
    "s3://bucket/ckpt/job-a//step_1",
    "s3://bucket/ckpt/job-a/..",
    "s3://bucket/ckpt/job-a/step_1?x=../job-b",
    "s3://bucket/ckpt/job-a\\..\\job-b",
])
def test_dot_dot_and_other_spellings_that_leave_the_prefix_are_denied(url):
    message = denied(lambda: within_url_prefix(JOB, url))
    assert repr(url) in message
    denied(lambda: within_prefix(JOB, url))


def test_a_local_path_against_a_url_prefix_and_the_reverse_are_denied():
    for path in ("/tmp/ckpt/job-a", "step_00000001", "bucket/ckpt/job-a/step_1",
                 "file:///bucket/ckpt/job-a"):
        denied(lambda p=path: within_prefix(JOB, p))
        denied(lambda p=path: within_url_prefix(JOB, p))
    for url in ("s3://bucket/ckpt/job-a/step_1", "s3://kc/ckpt/job-a"):
        denied(lambda u=url: within_prefix("/kc/ckpt/job-a", u))
        denied(lambda u=url: within_url_prefix("/kc/ckpt/job-a", u))


def test_no_prefix_grants_no_url():
    assert "grants no checkpoint path" in denied(lambda: within_prefix("", JOB + "/step_1"))
