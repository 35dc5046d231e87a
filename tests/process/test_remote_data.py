"""`data.path: s3://...` on a rank (workers/data/remote.py), against a real S3 server
(moto's, tests/s3server.py): the objects are mirrored into the node's cache, fetched
again only when they change, and read by the same readers as local files, with the
same tokens."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from kuangchao.platform.spec.jobspec import DataSection
from kuangchao.platform.storage import access
from kuangchao.platform.storage.objects import StoreCredentials
from kuangchao.workers.data import corpus, remote
from kuangchao.workers.data.readers import CACHE_FOLDER
from kuangchao.workers.data.sampling import load_corpus
from kuangchao.workers.data.tokenized import load_tokenized
from kuangchao.workers.errors import DataError
from kuangchao.workers.trainer.job_data import data_location
from tests.hf_fixtures import VOCAB, tiny_tokenizer, write_datasets
from tests.s3server import S3Server

BUCKET = "kc-data"
SEQ = 32


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_datasets(tmp_path_factory.mktemp("data"), 24)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(autouse=True)
def node(s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh node: its own cache folders, the operator's credentials for the server."""
    s3.use_admin_env(monkeypatch)
    monkeypatch.setenv("KC_NODE_DIR", str(tmp_path / "node"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    access.forget_job_credentials()
    yield tmp_path / "node"
    access.forget_job_credentials()
    corpus.set_read_guard(None)


def upload(s3: S3Server, prefix: str, files: dict[str, bytes]) -> None:
    client = s3.client()
    for name, body in files.items():
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=body)


def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not any(s.startswith(".") for s in p.relative_to(folder).parts)}


def last_sync(url: str) -> dict:
    from kuangchao.platform.security.admission import split_url_glob
    from kuangchao.platform.storage.urls import parse

    base, pattern = split_url_glob(url)
    return remote.read_index(remote.cache_folder(parse(base), pattern))["last_sync"]


def mtimes(folder: Path) -> dict[str, int]:
    return {p.relative_to(folder).as_posix(): p.stat().st_mtime_ns for p in folder.rglob("*")
            if p.is_file()}


def test_a_prefix_is_mirrored_once_and_then_only_what_changed(s3, datasets):
    texts = {p.name: p.read_bytes() for p in sorted(datasets["text"].iterdir())}
    upload(s3, "mirror/text", {**texts, "nested/more.txt": b"more text\n", ".DS_Store": b"junk"})
    url = f"s3://{BUCKET}/mirror/text"
    local = remote.local_copy(url)
    assert local.is_dir() and local.is_relative_to(access.cache_dir("data"))
    assert folder_files(local) == {**texts, "nested/more.txt": b"more text\n"}  # hidden: skipped
    assert not (local / ".DS_Store").exists()
    assert len(last_sync(url)["downloaded"]) == len(texts) + 1
    before = mtimes(local)

    # Nothing changed: nothing is downloaded, the files are untouched.
    assert remote.local_copy(url + "/") == local  # the same prefix, written with a slash
    assert last_sync(url)["downloaded"] == [] and mtimes(local) == before

    # One object changed (to the same size: its ETag tells), one deleted, one added: exactly those.
    first = sorted(texts)[0]
    changed = b"x" * len(texts[first])
    client = s3.client()
    client.put_object(Bucket=BUCKET, Key=f"mirror/text/{first}", Body=changed)
    client.delete_object(Bucket=BUCKET, Key="mirror/text/nested/more.txt")
    client.put_object(Bucket=BUCKET, Key="mirror/text/new.txt", Body=b"new\n")
    assert remote.local_copy(url) == local
    assert last_sync(url) == {"downloaded": [first, "new.txt"], "removed": ["nested/more.txt"]}
    after = mtimes(local)
    assert [n for n in before if n in after and after[n] != before[n]] == [first]
    assert (local / first).read_bytes() == changed and not (local / "nested").exists()


def test_one_object_and_a_glob_give_what_the_readers_expect(s3, datasets):
    upload(s3, "mixed", {"a.jsonl": b'{"text": "a"}\n', "sub/b.jsonl": b'{"text": "b"}\n',
                         "notes.txt": b"not data", "deep/x/c.jsonl": b'{"text": "c"}\n'})
    file = remote.local_copy(f"s3://{BUCKET}/mixed/a.jsonl")
    assert file.is_file() and file.name == "a.jsonl" and file.read_bytes() == b'{"text": "a"}\n'

    pattern = remote.local_copy(f"s3://{BUCKET}/mixed/*.jsonl")
    assert pattern.name == "*.jsonl" and folder_files(pattern.parent) == {"a.jsonl": b'{"text": "a"}\n'}
    recursive = remote.local_copy(f"s3://{BUCKET}/mixed/**/*.jsonl")
    assert sorted(folder_files(recursive.parent.parent)) == ["a.jsonl", "deep/x/c.jsonl", "sub/b.jsonl"]
    # A glob that names a folder brings the folder (the readers walk it).
    folder = remote.local_copy(f"s3://{BUCKET}/mixed/s*")
    assert sorted(folder_files(folder.parent)) == ["sub/b.jsonl"]

    # The raw byte reader reads the copy as it would the file.
    raw = load_corpus(str(file), 1 << 20, 256, roots=None)
    assert bytes(raw.astype("uint8")) == b'{"text": "a"}\n'


def test_the_copy_tokenizes_to_the_same_tokens_as_the_local_files(s3, datasets, tok_dir):
    upload(s3, "tok", {"docs.jsonl": datasets["jsonl"].read_bytes(),
                       "README.md": b"# not part of the data\n"})
    upload(s3, "tok/text", {p.name: p.read_bytes() for p in datasets["text"].iterdir()})
    cases = [(f"s3://{BUCKET}/tok/*.jsonl", "jsonl", datasets["jsonl"]),
             (f"s3://{BUCKET}/tok/text", "text", datasets["text"])]
    for url, fmt, local_source in cases:
        path, roots = data_location(url)  # the rank's one place that resolves data.path
        assert roots is None and Path(path).is_relative_to(access.cache_dir("data"))
        got = load_tokenized(DataSection(path=path, format=fmt), str(tok_dir), SEQ,
                             vocab_limit=VOCAB, roots=None)
        want = load_tokenized(DataSection(path=str(local_source), format=fmt), str(tok_dir), SEQ,
                              vocab_limit=VOCAB, roots=None)
        assert got.tokens.size > SEQ and np.array_equal(got.tokens, want.tokens), url
        # The tokenized cache is kept inside the copy, never in the store.
        copy_root = Path(path).parent if "*" in path else Path(path)
        assert got.cache_dir.parent == copy_root / CACHE_FOLDER
        # A second load reuses the copy and its tokenized cache.
        again = load_tokenized(DataSection(path=data_location(url)[0], format=fmt), str(tok_dir),
                               SEQ, vocab_limit=VOCAB, roots=None)
        assert again.cache_dir == got.cache_dir and last_sync(url)["downloaded"] == []
    listed = s3.client().list_objects_v2(Bucket=BUCKET, Prefix="tok/")["Contents"]
    assert not any(CACHE_FOLDER in o["Key"] for o in listed)
    # A local data.path is still the local path, held to the data roots.
    assert data_location(str(datasets["jsonl"]))[1] is not None


def test_what_is_missing_is_named_with_data_path_and_what_to_change(s3):
    with pytest.raises(DataError) as info:
        remote.local_copy(f"s3://{BUCKET}/no/such/data.jsonl")
    assert str(info.value).startswith("data.path: ") and "does not exist" in str(info.value)
    assert "fix data.path" in str(info.value)
    with pytest.raises(DataError) as info:
        remote.local_copy("s3://kc-no-such-bucket/data")
    assert "bucket 'kc-no-such-bucket' does not exist" in str(info.value)
    with pytest.raises(DataError) as info:
        remote.local_copy(f"s3://{BUCKET}/no/such/*.jsonl")
    assert "matches no objects" in str(info.value)
    # Nothing was written for a URL that names nothing.
    assert not access.cache_dir("data").exists() or not any(access.cache_dir("data").iterdir())
    # A rank granted no store credentials says so, rather than using its node's.
    access.use_job_credentials(None)
    with pytest.raises(DataError) as info:
        remote.local_copy(f"s3://{BUCKET}/no/such/data.jsonl")
    assert "granted no object-store credentials" in str(info.value)


def test_the_data_loader_token_is_asked_with_the_url_before_the_store(s3):
    upload(s3, "guarded", {"a.txt": b"a"})
    asked: list[str] = []

    def deny(what: str) -> None:
        asked.append(what)
        raise PermissionError(f"no dataset_read for {what}")

    corpus.set_read_guard(deny)
    with pytest.raises(PermissionError):
        remote.local_copy(f"s3://{BUCKET}/guarded")
    assert asked == [f"s3://{BUCKET}/guarded"] and not access.cache_dir("data").exists()


def test_ranks_on_one_node_download_each_object_once(s3, monkeypatch):
    upload(s3, "shared", {f"f{i}.txt": bytes([65 + i]) * 1000 for i in range(12)})
    calls: list[str] = []
    real = remote._download

    def counted(fs, path, dest):
        calls.append(path)
        return real(fs, path, dest)

    monkeypatch.setattr(remote, "_download", counted)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(remote.local_copy(f"s3://{BUCKET}/shared")))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and len(set(results)) == 1
    assert sorted(calls) == sorted(f"{BUCKET}/shared/f{i}.txt" for i in range(12))
    assert len(folder_files(results[0])) == 12


def test_credentials_the_store_refuses_are_named_as_such():
    with S3Server(enforce_auth=True) as secured:
        secured.create_bucket(BUCKET)
        secured.client().put_object(Bucket=BUCKET, Key="d/a.txt", Body=b"a")
        iam = secured.client("iam")
        iam.create_user(UserName="nobody")  # no policy: every S3 call is denied
        key = iam.create_access_key(UserName="nobody")["AccessKey"]
        access.use_job_credentials(StoreCredentials(
            key=key["AccessKeyId"], secret=key["SecretAccessKey"], endpoint_url=secured.endpoint,
            region="us-east-1"))
        with pytest.raises(DataError) as info:
            remote.local_copy(f"s3://{BUCKET}/d")
        message = str(info.value)
        assert message.startswith("data.path: ") and "refused the credentials" in message, message
        # The operator's own keys read it (the job's grant is what was refused).
        access.forget_job_credentials()
        with pytest.MonkeyPatch.context() as mp:
            secured.use_admin_env(mp)
            assert folder_files(remote.local_copy(f"s3://{BUCKET}/d")) == {"a.txt": b"a"}
