"""Checkpoints in a real S3 server (moto's, tests/s3server.py) from two real gloo ranks
(processes), each with a private node folder of its own (`KC_NODE_DIR`), as ranks on
two machines that share no disk.

- Saved synchronously and in the background, pruned to `keep_last` in the store, and
  restored by fresh managers into fresh models with exactly the state saved; a rank's
  folder never holds the other rank's files after a save, and with `local_staging` it
  keeps its own, so that a restore downloads only the rest.
- A checkpoint truncated or altered (same size) in the store is skipped for the one
  before it.
- A store that stops answering (SIGSTOP) during a background save fails that save
  at its upload deadline, after telling the job of each retry; once the store is
  back, the next save commits.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from kuangchao.platform.protocol.checkpoint import step_dir_name
from kuangchao.platform.runtime.procs import free_port
from kuangchao.platform.storage import access
from kuangchao.platform.storage.mirror import RemoteCheckpoints
from kuangchao.platform.storage.objects import filesystem
from kuangchao.platform.storage.urls import parse
from kuangchao.workers.checkpoint.manager import CheckpointManager
from kuangchao.workers.errors import CheckpointError
from kuangchao.workers.models.factory import ModelConfig, build_model
from tests.s3server import S3Server

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::UserWarning")]

BUCKET = "kc-ckpt"
ROOT = f"s3://{BUCKET}/runs"
CFG = ModelConfig(type="gpt", n_layers=1, n_heads=2, d_model=32, seq_len=8, vocab_size=64)
JOBS = {"job-plain": None, "job-staged": "staging"}  # job id: checkpoint.local_staging
# The frozen store: a save's upload deadline and each request's wait for a response,
# cut from 120 s and 15 s (the retry loop only looks at the deadline between tries).
FROZEN_DEADLINE_S = 8.0
FROZEN_READ_TIMEOUT_S = 1
# How long a rank waits for the save to the frozen store to end: its deadline, plus the
# try in flight then (botocore's two attempts of FROZEN_READ_TIMEOUT_S and its backoff).
FROZEN_WAIT_S = FROZEN_DEADLINE_S + 15


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture
def env(s3, tmp_path, monkeypatch):
    """The operator's credentials for the server, a KC_HOME of the test's own; the ranks
    spawned from here inherit both."""
    s3.use_admin_env(monkeypatch)
    monkeypatch.setenv("KC_HOME", str(tmp_path / "kc-home"))
    monkeypatch.delenv("KC_NODE_DIR", raising=False)
    access.forget_job_credentials()
    yield tmp_path
    access.forget_job_credentials()


# -- in the ranks -----------------------------------------------------------------------


def _make(seed: int):
    torch.manual_seed(seed)
    model = build_model(CFG)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(ddp, opt, rank: int, steps: int = 1) -> None:
    for _ in range(steps):
        x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len),
                          generator=torch.Generator().manual_seed(rank))
        _, loss = ddp(x, x)
        loss.backward()  # DDP all-reduces: both ranks hold the same state
        opt.step()
        opt.zero_grad(set_to_none=True)


def _snapshot(model, opt) -> tuple[dict, list[dict]]:
    return ({k: v.clone() for k, v in model.state_dict().items()},
            [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
             for s in opt.state.values()])


def _same_state(expected, model, opt) -> None:
    weights, opt_state = expected
    got = model.state_dict()
    assert set(got) == set(weights)
    for k, v in weights.items():
        assert torch.equal(got[k], v), k
    states = list(opt.state.values())
    assert len(states) == len(opt_state) > 0
    for i, (want, have) in enumerate(zip(opt_state, states, strict=True)):
        assert set(want) == set(have), i
        for k, v in want.items():
            assert torch.equal(torch.as_tensor(have[k]), torch.as_tensor(v)), (i, k)


def _own(name: str, rank: int) -> bool:
    """Whether a checkpoint file is one rank `rank` writes itself."""
    return (name.startswith(f"__{rank}_") or name == f"rank_{rank}.pt"
            or (rank == 0 and name == ".metadata"))


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".lock"))


def _init(rank: int, port: int, node_dir: str) -> None:
    os.environ["KC_NODE_DIR"] = node_dir  # this rank's private folder: its "machine"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)


def _save_and_restore(rank: int, port: int, nodes: list[str], out: str) -> None:
    _init(rank, port, nodes[rank])
    node = Path(nodes[rank])
    ddp = None
    try:
        model, opt = _make(0)
        ddp = DistributedDataParallel(model)
        mgrs = {job: CheckpointManager(ROOT, job, rank, 2, "h", keep_last=2, local_staging=staging)
                for job, staging in JOBS.items()}
        for step in (1, 2, 3, 4):
            _train(ddp, opt, rank)
            for mgr in mgrs.values():
                if step in (2, 3):  # in the background, training goes on meanwhile
                    mgr.save_async(step, model, opt, rank_state={"rank": rank, "step": step})
                else:
                    mgr.save(step, model, opt, rank_state={"rank": rank, "step": step})
        for mgr in mgrs.values():
            assert mgr.wait() is None or mgr.last_committed.step == 4
            assert mgr.last_committed.step == 4
            if rank == 0:
                assert mgr.wait_pruned(60)
        expected = _snapshot(model, opt)
        dist.barrier()

        # After saving: no staging, nothing of any checkpoint is left on the node; with
        # staging, the node keeps this rank's own files and never the other rank's.
        plain, staged = mgrs["job-plain"].dir, mgrs["job-staged"].dir
        assert _files(plain) == [], _files(plain)
        assert all(_own(p.name, rank) for p in _files(node)), _files(node)  # anywhere on it
        kept = _files(staged)
        assert kept and all(_own(p.name, rank) for p in kept), kept
        assert sorted({p.parent.name for p in kept}) == [step_dir_name(3), step_dir_name(4)]
        assert {f"rank_{rank}.pt"} <= {p.name for p in kept if p.parent.name == step_dir_name(4)}
        own_before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns)
                      for p in kept if p.parent.name == step_dir_name(4)}
        dist.barrier()

        # A fresh pair of managers and models restores exactly what was saved.
        report: dict = {"rank": rank, "own": sorted(own_before)}
        for job, staging in JOBS.items():
            fresh, fresh_opt = _make(100 + rank)
            mgr = CheckpointManager(ROOT, job, rank, 2, "h", keep_last=2, local_staging=staging)
            path, manifest = mgr.latest_verified()
            assert manifest["step"] == 4 and manifest["world_size"] == 2
            assert [p.name for p in mgr.list()] == [step_dir_name(3), step_dir_name(4)]
            assert mgr.load(path, fresh, fresh_opt) == {"rank": rank, "step": 4}
            _same_state(expected, fresh, fresh_opt)
            local = {p.name for p in _files(path)}
            assert local == set(manifest["files"]) | {"manifest.json"}, (job, local)
            if staging:  # the own files were read where they were; only the rest came
                after = {n: ((path / n).stat().st_ino, (path / n).stat().st_mtime_ns)
                         for n in own_before}
                assert after == own_before
                report["fetched"] = sorted(set(manifest["files"]) - set(own_before))
                assert report["fetched"] and not any(_own(n, rank) for n in report["fetched"])
        Path(out, f"rank{rank}.json").write_text(json.dumps(report))
        dist.barrier()
    finally:
        ddp = None  # the reducer before the group it holds (gloo's destructor can hang otherwise)
        dist.destroy_process_group()


def _frozen_store(rank: int, port: int, nodes: list[str], out: str, ready, frozen, failed,
                  thawed) -> None:
    from kuangchao.platform.storage import mirror, objects

    objects.READ_TIMEOUT_S = FROZEN_READ_TIMEOUT_S  # before the manager opens its filesystem
    mirror.UPLOAD_DEADLINE_S = FROZEN_DEADLINE_S
    _init(rank, port, nodes[rank])
    ddp = None
    try:
        model, opt = _make(0)
        ddp = DistributedDataParallel(model)
        events: list[dict] = []
        mgr = CheckpointManager(ROOT, "job-frozen", rank, 2, "h", keep_last=3,
                                on_event=events.append)
        _train(ddp, opt, rank)
        mgr.save(1, model, opt, rank_state={})
        if rank == 0:  # the commit's pruning lists the store: done before it freezes
            assert mgr.wait_pruned(60)
        dist.barrier()
        if rank == 0:
            ready.set()
        assert frozen.wait(60), "the test never froze the store"

        start = time.monotonic()
        mgr.save_async(2, model, opt, rank_state={})
        _train(ddp, opt, rank, steps=2)  # training goes on while the upload hangs
        try:
            mgr.wait(timeout=FROZEN_WAIT_S)
        except CheckpointError as exc:
            error = exc.message
        else:
            error = None
        # what the frozen store did, for the test to check while the store is still frozen
        Path(out, f"rank{rank}-frozen.json").write_text(json.dumps(
            {"error": error, "elapsed": time.monotonic() - start, "events": events,
             "pending": mgr.pending is not None}))
        dist.barrier()
        if rank == 0:
            failed.set()
        assert thawed.wait(60), "the test never thawed the store"

        _train(ddp, opt, rank)
        info = mgr.save(3, model, opt, rank_state={})
        Path(out, f"rank{rank}.json").write_text(json.dumps({"committed": info.step}))
        dist.barrier()
    finally:
        ddp = None
        dist.destroy_process_group()


# -- the tests ----------------------------------------------------------------------------


def _nodes(tmp: Path) -> list[str]:
    nodes = [tmp / f"node{r}" for r in range(2)]
    for n in nodes:
        n.mkdir()
    return [str(n) for n in nodes]


def _store(job: str) -> RemoteCheckpoints:
    return RemoteCheckpoints(parse(ROOT).join(job), filesystem("s3"))


def _keys(s3: S3Server, prefix: str) -> list[str]:
    listing = s3.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for o in listing.get("Contents", []))


@pytest.fixture(scope="module")
def saved(s3, tmp_path_factory):
    """Two ranks saved steps 1 to 4 of both jobs and restored them (`_save_and_restore`)."""
    tmp = tmp_path_factory.mktemp("two-ranks")
    with pytest.MonkeyPatch.context() as mp_env:
        s3.use_admin_env(mp_env)
        mp_env.setenv("KC_HOME", str(tmp / "kc-home"))
        mp_env.delenv("KC_NODE_DIR", raising=False)
        out = tmp / "out"
        out.mkdir()
        start = time.monotonic()
        mp.spawn(_save_and_restore, args=(free_port(), _nodes(tmp), str(out)), nprocs=2, join=True)
        took = time.monotonic() - start
    return tmp, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)], took


def test_two_ranks_save_prune_and_restore_through_the_store(s3, env, saved):
    _, reports, took = saved
    assert took < 120
    for job in JOBS:
        store = _store(job)
        assert store.committed_steps() == [3, 4]  # keep_last=2: steps 1 and 2 retired
        for step in (1, 2):
            assert _keys(s3, f"runs/{job}/{step_dir_name(step)}/") == []
        manifest = store.shallow_verify(4)
        assert manifest["step"] == 4
        assert {"rank_0.pt", "rank_1.pt", ".metadata"} <= set(manifest["files"])
        names = {k.rsplit("/", 1)[-1] for k in _keys(s3, f"runs/{job}/{step_dir_name(4)}/")}
        assert names == set(manifest["files"]) | {"manifest.json"}
    # with staging, each rank fetched only what the other wrote
    own = [set(r["own"]) for r in reports]
    assert not own[0] & own[1]
    assert set(reports[0]["fetched"]) <= own[1] | set(_store("job-staged").manifest(4)["files"])
    assert "rank_1.pt" in reports[0]["fetched"] and "rank_0.pt" in reports[1]["fetched"]


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]


def test_a_checkpoint_truncated_or_altered_in_the_store_is_skipped_for_the_one_before(
        s3, env, saved, monkeypatch):
    monkeypatch.setenv("KC_NODE_DIR", str(env / "restoring-node"))
    job = "job-plain"
    manifest = _store(job).manifest(4)
    name = max(manifest["files"], key=lambda n: manifest["files"][n]["bytes"])
    key = f"runs/{job}/{step_dir_name(4)}/{name}"
    client = s3.client()
    good = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    assert len(good) == manifest["files"][name]["bytes"] > 16

    def latest_step() -> int:
        mgr = CheckpointManager(ROOT, job, 0, 2, "h", keep_last=2)
        found = mgr.latest_verified()
        assert found is not None
        return found[1]["step"]

    try:
        client.put_object(Bucket=BUCKET, Key=key, Body=good[: len(good) // 2])  # truncated
        assert latest_step() == 3
        with pytest.raises(CheckpointError, match=f"{name} has {len(good) // 2} bytes in the store"):
            _store(job).shallow_verify(4)
        client.put_object(Bucket=BUCKET, Key=key, Body=_flip(good, len(good) // 2))  # same size
        _store(job).shallow_verify(4)  # the sizes cannot tell
        assert latest_step() == 3  # the checksum does
    finally:
        client.put_object(Bucket=BUCKET, Key=key, Body=good)
    assert latest_step() == 4  # the same store, whole again: step 4 is the latest


def _wait_for(event, ctx, timeout: float, what: str) -> None:
    """Wait for `event`, raising at once if a rank died (its traceback) and at `timeout`."""
    deadline = time.monotonic() + timeout
    while not event.wait(0.5):
        ctx.join(timeout=0)  # raises ProcessRaisedException when a rank failed
        if time.monotonic() > deadline:
            raise AssertionError(f"the ranks did not get to {what} within {timeout:.0f} s")


def test_a_frozen_store_fails_the_save_in_flight_at_its_deadline_and_the_next_save_commits(
        s3, env):
    out = env / "out"
    out.mkdir()
    spawn = mp.get_context("spawn")
    ready, frozen, failed, thawed = (spawn.Event() for _ in range(4))
    ctx = mp.spawn(_frozen_store, args=(free_port(), _nodes(env), str(out), ready, frozen, failed,
                                        thawed), nprocs=2, join=False)
    try:
        _wait_for(ready, ctx, 120, "their first save")
        with s3.frozen():
            frozen.set()
            _wait_for(failed, ctx, FROZEN_WAIT_S + 15, "the end of the save in flight")
            for rank in range(2):
                report = json.loads((out / f"rank{rank}-frozen.json").read_text())
                error = report["error"]
                assert error is not None, f"rank {rank}: the save to a frozen store succeeded"
                assert not report["pending"], f"rank {rank}: {error}"
                assert "checkpoint step 2" in error and "while uploading" in error, error
                assert "upload of" in error and "(step 2) failed after" in error, error
                # at its deadline, not after s3fs's and botocore's own minutes of retries
                assert FROZEN_DEADLINE_S - 1 <= report["elapsed"] < FROZEN_WAIT_S
                retries = [e for e in report["events"] if e["type"] == "checkpoint_retry"]
                assert retries, f"rank {rank}: the job heard of no retry"
                tries: dict[str, list[int]] = {}  # by file: its failed tries, told in order
                for e in retries:
                    assert "upload of" in e["message"] and "(step 2)" in e["message"], e
                    tries.setdefault(e["message"].split(":")[0], []).append(e["attempt"])
                assert all(t == list(range(1, len(t) + 1)) for t in tries.values()), tries
        thawed.set()
        deadline = time.monotonic() + 90
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "the ranks did not finish after the thaw"
    finally:
        for proc in ctx.processes:  # only when the test failed: the ranks exit on their own
            if proc.is_alive():
                proc.kill()
    for rank in range(2):
        assert json.loads((out / f"rank{rank}.json").read_text())["committed"] == 3
    assert _store("job-frozen").committed_steps() == [1, 3]  # step 2 never got its manifest
    assert _store("job-frozen").shallow_verify(3)["step"] == 3
