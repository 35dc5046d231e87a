"""One job's checkpoints in an object store (platform/storage/mirror.py), against
fsspec's in-memory filesystem (a real fsspec implementation, no network): the
manifest is the commit (uploaded last, retired first), a store's checkpoint is
checked by size without a download and by checksum once fetched, a fetch takes
only what the local folder lacks, and uploads are retried until a deadline.

The checkpoints are real ones, written by `CheckpointManager` to a local folder and
uploaded file by file. The last tests run the manager itself on a `memory://` URL.
"""

from __future__ import annotations

import json
import shutil
import threading
import uuid
from pathlib import Path

import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from kuangchao.platform.protocol.checkpoint import MANIFEST, step_dir_name, verify
from kuangchao.platform.storage import access, mirror
from kuangchao.platform.storage.mirror import RemoteCheckpoints, retrying
from kuangchao.platform.storage.urls import parse
from kuangchao.workers.checkpoint.manager import CheckpointManager
from kuangchao.workers.errors import CheckpointError
from kuangchao.workers.models.factory import ModelConfig, build_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CFG = ModelConfig(type="gpt", n_layers=1, n_heads=2, d_model=16, seq_len=8, vocab_size=32)
STEPS = (1, 2, 3)


class RecordingFS(MemoryFileSystem):
    """The in-memory filesystem, recording the transfers and deletions mirror.py makes
    (in order), and failing the next `fail[name]` puts of an object named `name`."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.log: list[tuple[str, str]] = []
        self.fail: dict[str, int] = {}
        self.on_get = None  # called with the local path before each download
        self._lock = threading.Lock()

    def _record(self, op: str, path: str) -> None:
        with self._lock:
            self.log.append((op, path.rsplit("/", 1)[-1]))

    def calls(self, op: str) -> list[str]:
        return [name for o, name in self.log if o == op]

    def get_file(self, rpath, lpath, *args, **kw):
        self._record("get", rpath)
        if self.on_get is not None:
            self.on_get(Path(lpath))
        return super().get_file(rpath, lpath, *args, **kw)

    def put_file(self, lpath, rpath, *args, **kw):
        name = rpath.rsplit("/", 1)[-1]
        with self._lock:
            failing = self.fail.get(name, 0)
            if failing:
                self.fail[name] = failing - 1
        if failing:
            self._record("put-failed", rpath)
            raise ConnectionError(f"store unreachable for {name}")
        self._record("put", rpath)
        return super().put_file(lpath, rpath, *args, **kw)

    def pipe_file(self, path, value, *args, **kw):
        self._record("pipe", path)
        return super().pipe_file(path, value, *args, **kw)

    def rm_file(self, path):
        self._record("rm", path)
        return super().rm_file(path)


def make_model(seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(CFG)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, opt) -> None:
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=torch.Generator().manual_seed(1))
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def local_steps(tmp_path_factory) -> dict[int, Path]:
    """Real checkpoints of steps 1 to 3 in a local folder, by step."""
    root = tmp_path_factory.mktemp("written")
    mgr = CheckpointManager(root, "job-1", 0, 1, "h", keep_last=len(STEPS))
    model, opt = make_model()
    for step in STEPS:
        train(model, opt)
        mgr.save(step, model, opt, rank_state={"step": step})
    return {step: root / "job-1" / step_dir_name(step) for step in STEPS}


@pytest.fixture
def store():
    fs = RecordingFS(skip_instance_cache=True)  # a fresh instance (and log) per test
    bucket = f"kc-test-{uuid.uuid4().hex[:12]}"
    yield RemoteCheckpoints(parse(f"memory://{bucket}/ckpt/job-1"), fs)
    if fs.exists(bucket):
        fs.rm(bucket, recursive=True)


def files_of(folder: Path) -> dict[str, Path]:
    return {f.name: f for f in sorted(folder.iterdir()) if f.name != MANIFEST}


def manifest_of(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())


def publish(store: RemoteCheckpoints, folder: Path, step: int, commit: bool = True) -> dict:
    store.upload(step, files_of(folder))
    manifest = manifest_of(folder)
    if commit:
        store.commit(step, manifest)
    return manifest


def obj(store: RemoteCheckpoints, step: int, name: str) -> str:
    return store.step_url(step).join(name).path


def objects_under(store: RemoteCheckpoints, step: int) -> list[str]:
    """The objects left of `step` (the in-memory store may keep an empty pseudo-folder)."""
    return store.fs.find(store.step_url(step).path)


def flip_byte(data: bytes, at: int = 0) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]


def biggest_file(folder: Path) -> str:
    return max(files_of(folder).items(), key=lambda kv: kv[1].stat().st_size)[0]


# -- listing --------------------------------------------------------------------------


def test_only_steps_with_a_manifest_are_committed(store, local_steps):
    assert store.committed_steps() == []  # nothing there yet: not an error
    publish(store, local_steps[1], 1)
    publish(store, local_steps[2], 2, commit=False)  # a save that died before its commit
    publish(store, local_steps[3], 3)
    store.fs.pipe_file(f"{store.url.path}/step_x/{MANIFEST}", b"{}")  # not a step folder
    sibling = RemoteCheckpoints(parse(str(store.url) + "0"), store.fs)  # job-10 beside job-1
    publish(sibling, local_steps[1], 5)
    assert store.committed_steps() == [1, 3]
    assert sibling.committed_steps() == [5]


def test_upload_then_commit_puts_the_manifest_last(store, local_steps):
    folder = local_steps[2]
    store.upload(2, files_of(folder))
    assert store.committed_steps() == []  # every file in, no manifest: invisible
    assert sorted(store.fs.calls("put")) == sorted(files_of(folder))
    store.commit(2, manifest_of(folder))
    assert store.fs.log[-1] == ("pipe", MANIFEST)
    assert [op for op, _ in store.fs.log[:-1]] == ["put"] * len(files_of(folder))
    assert store.committed_steps() == [2]
    assert store.manifest(2) == manifest_of(folder)
    for name, path in files_of(folder).items():
        assert store.fs.cat_file(obj(store, 2, name)) == path.read_bytes()


# -- checking without a download --------------------------------------------------------


def test_shallow_verify_passes_a_whole_step(store, local_steps):
    manifest = publish(store, local_steps[1], 1)
    assert store.shallow_verify(1) == manifest
    assert store.fs.calls("get") == []  # nothing downloaded


def test_shallow_verify_refuses_a_missing_object_naming_it(store, local_steps):
    publish(store, local_steps[1], 1)
    store.fs.rm_file(obj(store, 1, "rank_0.pt"))
    with pytest.raises(CheckpointError, match=r"file rank_0\.pt listed in the manifest is missing "
                                               r"from the store"):
        store.shallow_verify(1)


def test_shallow_verify_refuses_an_object_of_the_wrong_size(store, local_steps):
    manifest = publish(store, local_steps[1], 1)
    name = biggest_file(local_steps[1])
    size = manifest["files"][name]["bytes"]
    store.fs.pipe_file(obj(store, 1, name), (local_steps[1] / name).read_bytes()[:-1])
    with pytest.raises(CheckpointError) as info:
        store.shallow_verify(1)
    assert f"{name} has {size - 1} bytes in the store, the manifest says {size}" in info.value.message


def test_shallow_verify_refuses_a_step_without_a_manifest_or_with_a_bad_one(store, local_steps):
    publish(store, local_steps[1], 1, commit=False)
    with pytest.raises(CheckpointError, match="no manifest.json; the checkpoint is partial"):
        store.shallow_verify(1)
    store.fs.pipe_file(obj(store, 1, MANIFEST), b"not json")
    with pytest.raises(CheckpointError, match="is corrupt"):
        store.shallow_verify(1)
    bad = manifest_of(local_steps[1])
    bad["files"]["../job-2/step_00000001/rank_0.pt"] = {"bytes": 1, "crc32": "0"}
    store.commit(1, bad)
    with pytest.raises(CheckpointError, match="which is not a file of the checkpoint"):
        store.shallow_verify(1)


def test_latest_skips_broken_steps_newest_first_and_says_why(store, local_steps):
    for step in STEPS:
        publish(store, local_steps[step], step)
    name = biggest_file(local_steps[3])
    store.fs.pipe_file(obj(store, 3, name), b"short")
    store.fs.rm_file(obj(store, 2, "rank_0.pt"))
    skipped: list[tuple[int, str]] = []
    step, manifest = store.latest(lambda s, why: skipped.append((s, why)))
    assert (step, manifest) == (1, manifest_of(local_steps[1]))
    assert [s for s, _ in skipped] == [3, 2]
    assert name in skipped[0][1] and "bytes in the store" in skipped[0][1]
    assert "rank_0.pt" in skipped[1][1] and "missing from the store" in skipped[1][1]
    store.fs.rm_file(obj(store, 1, "rank_0.pt"))
    assert store.latest() is None


# -- fetching -------------------------------------------------------------------------


def test_fetch_downloads_every_file_writes_the_manifest_last_and_verifies(store, local_steps,
                                                                           tmp_path):
    manifest = publish(store, local_steps[1], 1)
    local = tmp_path / "node" / step_dir_name(1)
    seen_manifest = []
    store.fs.on_get = lambda _: seen_manifest.append((local / MANIFEST).exists())
    assert store.fetch(1, local) == manifest
    assert sorted(store.fs.calls("get")) == sorted(files_of(local_steps[1]))
    assert seen_manifest and not any(seen_manifest)  # no manifest while files were coming in
    assert verify(local) == manifest
    assert sorted(p.name for p in local.iterdir()) == sorted(p.name for p in local_steps[1].iterdir())
    # fetched again: the local copy is whole, nothing is downloaded
    store.fs.log.clear()
    assert store.fetch(1, local) == manifest
    assert store.fs.calls("get") == []


def test_fetch_downloads_only_what_the_local_folder_lacks(store, local_steps, tmp_path):
    publish(store, local_steps[2], 2)
    local = tmp_path / step_dir_name(2)
    local.mkdir()
    own = ["rank_0.pt", ".metadata"]  # a rank's own files, kept from its save
    for name in own:
        shutil.copy2(local_steps[2] / name, local / name)
    (local / "__0_0.distcp").write_bytes(b"partial")  # the wrong size: fetched again
    store.fetch(2, local)
    assert sorted(store.fs.calls("get")) == sorted(set(files_of(local_steps[2])) - set(own))
    verify(local)


def test_local_files_of_the_right_size_but_wrong_content_are_fetched_again_once(store, local_steps,
                                                                                tmp_path):
    publish(store, local_steps[1], 1)
    local = tmp_path / step_dir_name(1)
    shutil.copytree(local_steps[1], local)
    (local / MANIFEST).unlink()
    name = biggest_file(local_steps[1])
    (local / name).write_bytes(flip_byte((local / name).read_bytes(), 100))
    assert store.fetch(1, local) == manifest_of(local_steps[1])
    # Kept at first (right size), then, failing the checksum, every kept file fetched again.
    assert sorted(store.fs.calls("get")) == sorted(manifest_of(local_steps[1])["files"])
    assert (local / name).read_bytes() == (local_steps[1] / name).read_bytes()


def test_a_step_corrupt_in_the_store_is_refused_naming_the_file(store, local_steps, tmp_path):
    publish(store, local_steps[1], 1)
    name = biggest_file(local_steps[1])
    good = (local_steps[1] / name).read_bytes()
    store.fs.pipe_file(obj(store, 1, name), flip_byte(good, len(good) // 2))  # same size
    store.shallow_verify(1)  # sizes alone cannot tell
    local = tmp_path / step_dir_name(1)
    with pytest.raises(CheckpointError) as info:
        store.fetch(1, local)
    assert f"{name} fails its checksum" in info.value.message
    assert str(store.step_url(1)) in info.value.message
    assert store.fs.calls("get").count(name) == 2  # fetched once more before giving up
    assert not (local / MANIFEST).exists()  # the folder never looks like a checkpoint


def test_a_file_missing_from_the_store_fails_the_fetch_and_leaves_no_manifest(store, local_steps,
                                                                              tmp_path):
    publish(store, local_steps[1], 1)
    store.fs.rm_file(obj(store, 1, "rank_0.pt"))
    local = tmp_path / step_dir_name(1)
    with pytest.raises(CheckpointError, match=r"file rank_0\.pt listed in the manifest is missing"):
        store.fetch(1, local)
    assert not (local / MANIFEST).exists()


def test_fetching_an_uncommitted_step_fails(store, local_steps, tmp_path):
    publish(store, local_steps[1], 1, commit=False)
    with pytest.raises(CheckpointError, match="partial"):
        store.fetch(1, tmp_path / step_dir_name(1))
    assert store.fs.calls("get") == []


def test_a_step_saved_again_replaces_an_older_local_copy(store, local_steps, tmp_path):
    local = tmp_path / step_dir_name(1)
    publish(store, local_steps[1], 1)
    store.fetch(1, local)
    # step 1 rewritten in the store with other bytes of the same sizes (saved again after a
    # restart that fell back before it): the local manifest no longer matches, and every
    # file that differs must come again
    store.retire(1)
    publish(store, local_steps[2], 1)
    store.fs.log.clear()
    assert store.fetch(1, local) == manifest_of(local_steps[2])
    verify(local)
    assert store.fs.calls("get")  # something had to come again


def test_a_local_copy_damaged_after_its_fetch_is_fetched_again(store, local_steps, tmp_path):
    publish(store, local_steps[1], 1)
    local = tmp_path / step_dir_name(1)
    store.fetch(1, local)
    name = biggest_file(local_steps[1])
    (local / name).write_bytes(flip_byte((local / name).read_bytes(), 7))  # bit rot on the node
    assert store.fetch(1, local) == manifest_of(local_steps[1])
    verify(local)


# -- retiring -------------------------------------------------------------------------


def test_retire_removes_the_manifest_first_then_the_rest(store, local_steps):
    for step in (1, 2):
        publish(store, local_steps[step], step)
    store.retire(1)
    removed = store.fs.calls("rm")
    assert removed[0] == MANIFEST and sorted(removed[1:]) == sorted(files_of(local_steps[1]))
    assert store.committed_steps() == [2]
    assert objects_under(store, 1) == []
    store.retire(1)  # gone already: fine
    store.retire(7)  # never there: fine
    assert store.committed_steps() == [2]


def test_a_retire_cut_short_after_the_manifest_leaves_the_step_invisible(store, local_steps,
                                                                         monkeypatch):
    publish(store, local_steps[1], 1)

    def unreachable(*_a, **_k):
        raise ConnectionError("the store stopped answering")

    monkeypatch.setattr(store.fs, "find", unreachable)  # after the manifest is gone
    with pytest.raises(ConnectionError):
        store.retire(1)
    monkeypatch.undo()
    assert store.committed_steps() == []
    assert store.fs.exists(obj(store, 1, "rank_0.pt"))  # the rest is still there, never listed
    assert store.latest() is None
    store.retire_partial(below=2)  # the next commit's sweep takes the rest
    assert objects_under(store, 1) == []


def test_retire_partial_deletes_uncommitted_steps_below_the_one_given(store, local_steps):
    store.retire_partial(below=10)  # an empty store: nothing to do
    publish(store, local_steps[1], 1)
    publish(store, local_steps[2], 2, commit=False)  # a save that died
    publish(store, local_steps[3], 3, commit=False)  # the save in flight
    publish(store, local_steps[1], 4, commit=False)  # above it: never touched either
    store.retire_partial(below=3)
    assert store.committed_steps() == [1]
    assert objects_under(store, 2) == []
    for step in (3, 4):
        assert store.fs.exists(obj(store, step, "rank_0.pt")), step
    assert store.shallow_verify(1) == manifest_of(local_steps[1])


# -- retrying -------------------------------------------------------------------------


@pytest.fixture
def no_backoff(monkeypatch):
    monkeypatch.setattr(mirror, "RETRY_BACKOFF_S", (0.0,))


def test_retrying_tells_each_failure_and_returns_once_it_works(no_backoff):
    results = iter([ConnectionError("reset"), TimeoutError("slow"), "done"])

    def flaky():
        r = next(results)
        if isinstance(r, Exception):
            raise r
        return r

    retries: list[tuple[int, str, str]] = []
    assert retrying(flaky, "upload of x", mirror.time.monotonic() + 60,
                    lambda *a: retries.append(a)) == "done"
    assert [(a, w) for a, w, _ in retries] == [(1, "upload of x"), (2, "upload of x")]
    assert "ConnectionError: reset" in retries[0][2] and "TimeoutError: slow" in retries[1][2]


def test_retrying_gives_up_at_the_deadline_naming_what(no_backoff):
    tries: list[int] = []
    retries: list[int] = []

    def failing():
        tries.append(1)
        raise ConnectionError("no route to store")

    start = mirror.time.monotonic()
    with pytest.raises(CheckpointError) as info:
        retrying(failing, "upload of rank_0.pt (step 4)", start + 0.2, lambda a, *_: retries.append(a))
    assert mirror.time.monotonic() - start < 5
    assert len(tries) >= 2
    assert retries == list(range(1, len(tries)))  # every failure but the last was told, in order
    assert info.value.message == (f"upload of rank_0.pt (step 4) failed after {len(tries)} tries: "
                                  "ConnectionError: no route to store")


def test_retrying_never_waits_past_the_deadline(monkeypatch):
    monkeypatch.setattr(mirror, "RETRY_BACKOFF_S", (30.0,))
    start = mirror.time.monotonic()
    with pytest.raises(CheckpointError, match="x failed after 1 tries: ZeroDivisionError"):
        retrying(lambda: 1 / 0, "x", start + 10)
    assert mirror.time.monotonic() - start < 5  # a 30 s wait would end past it: given up at once


def test_an_upload_that_fails_a_while_is_retried_and_lands(store, local_steps, no_backoff):
    store.fs.fail["rank_0.pt"] = 2
    events: list[tuple[int, str]] = []
    store.upload(3, files_of(local_steps[3]), lambda a, what, _: events.append((a, what)),
                 deadline=mirror.time.monotonic() + 30)
    assert events == [(1, "upload of rank_0.pt (step 3)"), (2, "upload of rank_0.pt (step 3)")]
    store.commit(3, manifest_of(local_steps[3]))
    assert store.shallow_verify(3) == manifest_of(local_steps[3])


def test_an_upload_past_its_deadline_fails_naming_the_file_and_nothing_is_committed(
        store, local_steps, no_backoff):
    store.fs.fail["rank_0.pt"] = 10 ** 9
    with pytest.raises(CheckpointError) as info:
        store.upload(3, files_of(local_steps[3]), deadline=mirror.time.monotonic() + 0.2)
    assert info.value.message.startswith("upload of rank_0.pt (step 3) failed after")
    assert "ConnectionError: store unreachable for rank_0.pt" in info.value.message
    assert store.committed_steps() == []


# -- the checkpoint manager on a memory:// URL (one process, world size 1) ---------------


@pytest.fixture
def node(tmp_path, monkeypatch):
    monkeypatch.setenv("KC_NODE_DIR", str(tmp_path / "node"))
    access.forget_job_credentials()
    bucket = f"kc-test-{uuid.uuid4().hex[:12]}"
    yield f"memory://{bucket}/ckpt", tmp_path / "node"
    fs = MemoryFileSystem(skip_instance_cache=True)
    if fs.exists(bucket):
        fs.rm(bucket, recursive=True)


def states_equal(a_model, a_opt, b_model, b_opt) -> None:
    for (k, v), w in zip(a_model.state_dict().items(), b_model.state_dict().values(), strict=True):
        assert torch.equal(v, w), k
    for s, t in zip(a_opt.state.values(), b_opt.state.values(), strict=True):
        for k in s:
            assert torch.equal(s[k], t[k]), k


@pytest.mark.parametrize("staging", [None, "staging"])
def test_the_manager_saves_to_a_url_prunes_the_store_and_restores(node, staging):
    root, node_dir = node
    mgr = CheckpointManager(root, "job-1", 0, 1, "h", keep_last=2, local_staging=staging)
    model, opt = make_model()
    for step in (1, 2, 3):
        train(model, opt)
        if step == 2:
            mgr.save_async(step, model, opt, rank_state={"step": step}).result()
        else:
            mgr.save(step, model, opt, rank_state={"step": step})
    assert mgr.wait_pruned(30)
    store = mgr.remote.store
    assert store.committed_steps() == [2, 3]
    assert objects_under(store, 1) == []
    local = sorted(p.relative_to(node_dir) for p in node_dir.rglob("*") if p.is_file())
    if staging is None:  # uploaded, then dropped from the node
        assert local == []
    else:  # the node keeps its own files (no manifest: the store holds the commit)
        kept = node_dir / "staging" / "job-1" / step_dir_name(3)
        assert sorted(p.name for p in kept.iterdir()) == sorted(
            n for n in store.manifest(3)["files"])
    fresh = CheckpointManager(root, "job-1", 0, 1, "h", keep_last=2, local_staging=staging)
    path, manifest = fresh.latest_verified()
    assert manifest["step"] == 3 and path.name == step_dir_name(3)
    other, other_opt = make_model(seed=5)
    assert fresh.load(path, other, other_opt) == {"step": 3}
    states_equal(model, opt, other, other_opt)
