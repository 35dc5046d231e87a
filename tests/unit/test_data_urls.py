"""`data.path` as an object-store URL at submission (platform/security/admission.py):
held to the operator's prefixes (`KC_DATA_URLS`) and to a scheme this install can
open, on the URL as written, without asking the store."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kuangchao.platform.errors import SpecError
from kuangchao.platform.security.admission import check_paths, split_url_glob, url_problem
from kuangchao.platform.settings import checkpoint_urls, data_urls
from kuangchao.platform.spec.data_files import data_file_errors

from .test_api_edge import SPEC, api  # noqa: F401 -- the fixture

PREFIXES = ("s3://datasets/public", "s3://team-a/data/")


def check(data_path: str, prefixes: tuple[str, ...] = PREFIXES, tmp: str = "/kc") -> None:
    check_paths(data_path, f"{tmp}/ckpt", (f"{tmp}/data",), (tmp,), data_urls=prefixes)


def refusal(data_path: str, prefixes: tuple[str, ...] = PREFIXES) -> str:
    with pytest.raises(SpecError) as info:
        check(data_path, prefixes)
    [(field, message)] = info.value.errors
    assert field == "data.path" and str(info.value).startswith("data.path: ")
    return message


def test_a_url_under_an_allowed_prefix_is_admitted_files_folders_and_globs():
    for url in ("s3://datasets/public", "s3://datasets/public/", "s3://datasets/public/wiki.jsonl",
                "s3://datasets/public/wiki/", "s3://team-a/data/chat/*.jsonl",
                "s3://team-a/data/**/*.parquet", "s3://team-a/data/part-??.txt",
                "s3://datasets/public/[ab]/*"):
        check(url)


def test_a_url_outside_every_prefix_is_refused_naming_the_prefixes_and_the_setting():
    for url in ("s3://datasets/private/x.jsonl", "s3://datasets/publicity/x",
                "s3://other/public/x", "s3://team-a/*/data/x.jsonl", "s3://team-a/dat*"):
        message = refusal(url)
        assert "outside the object-store prefixes" in message and "KC_DATA_URLS" in message
        assert "s3://datasets/public" in message
    # A key that climbs out of the prefix is refused too (object stores keep `..` literally).
    assert "'..'" in refusal("s3://datasets/public/../private/x")
    assert "'..'" in refusal("s3://datasets/public/*/../../private/*")


def test_no_object_store_data_unless_the_operator_allows_a_prefix():
    message = refusal("s3://datasets/public/wiki.jsonl", prefixes=())
    assert "lets jobs read none" in message and "KC_DATA_URLS" in message


def test_an_unknown_scheme_is_refused_with_what_to_use_instead():
    message = refusal("nosuchstore://datasets/public/x", prefixes=("nosuchstore://datasets",))
    assert "unknown URL scheme 'nosuchstore'" in message and "s3://bucket/prefix" in message


def test_a_wildcard_in_the_bucket_or_an_empty_segment_is_refused_with_how_to_write_it():
    assert "may not stand in the bucket name" in refusal("s3://data*/x.jsonl")
    assert "empty" in refusal("s3://datasets/public/*//x")
    assert split_url_glob("s3://b/d/e/*.jsonl") == ("s3://b/d/e", "*.jsonl")
    assert split_url_glob("s3://b/d/x?.txt") == ("s3://b/d", "x?.txt")
    assert split_url_glob("s3://b/d/x.txt") == ("s3://b/d/x.txt", None)
    assert split_url_glob("s3://b/*") == ("s3://b", "*")


def test_urls_and_local_paths_are_each_held_to_their_own_rule(tmp_path):
    # A local data path still has to be under the data roots; a URL never is.
    check(str(tmp_path / "data" / "x.bin").replace(str(tmp_path), "/kc"))
    with pytest.raises(SpecError) as info:
        check("/etc/passwd")
    assert "KC_DATA_ROOTS" in str(info.value)
    # Both refusals at once: the URL, and a checkpoint outside its roots.
    with pytest.raises(SpecError) as info:
        check_paths("s3://elsewhere/x", "/dev/shm/c", ("/kc/data",), ("/kc",), data_urls=PREFIXES)
    assert [f for f, _ in info.value.errors] == ["data.path", "checkpoint.path"]
    assert url_problem("s3://datasets/public/x", PREFIXES, "KC_DATA_URLS") is None


def test_the_prefixes_are_a_comma_or_whitespace_separated_setting(monkeypatch):
    monkeypatch.delenv("KC_DATA_URLS", raising=False)
    assert data_urls() == ()
    monkeypatch.setenv("KC_DATA_URLS", " s3://a/x, s3://b\n gs://c/d ,, ")
    assert data_urls() == ("s3://a/x", "s3://b", "gs://c/d")
    monkeypatch.setenv("KC_CHECKPOINT_URLS", "s3://ckpt/runs")
    assert checkpoint_urls() == ("s3://ckpt/runs",)


def test_submission_looks_at_no_object_store_file():
    spec = SimpleNamespace(data=SimpleNamespace(path="s3://datasets/public/x.jsonl", format="jsonl",
                                                field="text"))
    assert data_file_errors(spec) == []


def test_the_api_admits_a_url_only_under_kc_data_urls(api, monkeypatch):  # noqa: F811
    store, client, _ = api
    doc = {**SPEC, "data": {"path": "s3://datasets/public/corpus.bin"}}
    monkeypatch.delenv("KC_DATA_URLS", raising=False)
    resp = client.post("/v1/jobs?dry_run=true", json=doc)
    assert resp.status_code == 422 and "KC_DATA_URLS" in resp.text and "data.path" in resp.text
    monkeypatch.setenv("KC_DATA_URLS", "s3://datasets/public")
    resp = client.post("/v1/jobs?dry_run=true", json=doc)
    assert resp.status_code == 200, resp.text
    assert resp.json()["spec"]["data"]["path"] == "s3://datasets/public/corpus.bin"
    assert store.list() == []
