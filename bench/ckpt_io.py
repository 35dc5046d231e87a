"""Checkpoint I/O: our sharded save against `torch.save`, and what async saves cost training.

One process, no Ray, no Redis, no process group. The state is a GPT of 7.2M
parameters (29 MB of fp32 weights) with AdamW state after one step: about
88 MB in all. Reported, as medians over the repeats:

  ckpt_save_throughput         bytes/s of CheckpointManager.save (DCP shards,
                               rank file, fsync, checksum of every file,
                               manifest, rename; the old checkpoint's deletion
                               runs in the background, and is waited for
                               before the baseline) against torch.save of the
                               same model and optimizer state_dicts to one
                               file + fsync
  async_ckpt_blocked_fraction  seconds save_async holds the training loop
                               (staging to CPU memory) against a sync save
  s3_ckpt_throughput           bytes/s of CheckpointManager.save to
                               s3://<bucket>/bench on a local S3 server (moto,
                               started and stopped here): local write with
                               checksums, upload, manifest (the commit) against
                               s3fs uploading the same objects, same bytes, from
                               memory in one call
  s3_async_blocked_fraction    the share of a save_async to the same store,
                               from the call until the commit, that the caller
                               is blocked; baseline: the same share for a sync
                               save (1 by construction, measured)

Run: .venv/bin/python bench/ckpt_io.py [--repeats 5] [--dir /tmp] [--skip-s3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` when run as a script

from bench.harness import emit, log, median, wait_for_quiet  # noqa: E402
from kuangchao.workers.checkpoint.manager import CheckpointManager  # noqa: E402
from kuangchao.workers.models.factory import ModelConfig, build_model  # noqa: E402

REPEATS = 5
MODEL = ModelConfig(type="gpt", n_layers=4, n_heads=6, d_model=384, seq_len=128, vocab_size=256)


def make_state(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The benchmark model with AdamW state (exp_avg, exp_avg_sq) after one step."""
    torch.manual_seed(seed)
    model = build_model(MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, opt)
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_len))
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def torch_save_fsync(model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path) -> int:
    """The baseline: one `torch.save` file, fsynced so that both sides reach the disk."""
    with path.open("wb") as fh:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    return path.stat().st_size


@contextlib.contextmanager
def scratch(root: str | None):
    path = Path(tempfile.mkdtemp(prefix="kc-ckpt-bench-", dir=root))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def measure_save_throughput(repeats: int = REPEATS, root: str | None = None) -> dict[str, Any]:
    """Sync save bytes/s, ours vs torch.save + fsync, alternating, medians over `repeats`."""
    model, opt = make_state()
    log(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    wait_for_quiet()
    ours, theirs = [], []
    with scratch(root) as tmp:
        mgr = CheckpointManager(tmp, "bench", 0, 1, "bench", keep_last=1)
        mgr.save(0, model, opt, rank_state={})  # warm-up: first-call costs (imports, planner)
        for i in range(1, repeats + 1):
            # Alternate who goes first: the page cache and disk state favour neither.
            for side in ("ours", "torch") if i % 2 else ("torch", "ours"):
                if side == "ours":
                    info = mgr.save(i, model, opt, rank_state={})
                    ours.append(info.bytes / info.blocked_s)
                    mgr.wait_pruned()  # the previous checkpoint's deletion must not slow the baseline
                else:
                    t0 = time.perf_counter()
                    size = torch_save_fsync(model, opt, tmp / "baseline.pt")
                    theirs.append(size / (time.perf_counter() - t0))
            log(f"save {i}: ours {info.bytes / 1e6:.1f} MB in {info.bytes / ours[-1]:.3f}s, "
                f"torch.save {size / 1e6:.1f} MB in {size / theirs[-1]:.3f}s")
    return {"ours_bytes_per_s": median(ours), "baseline_bytes_per_s": median(theirs),
            "bytes": info.bytes, "repeats": repeats, "ours_runs": ours, "baseline_runs": theirs}


def measure_async_blocked(repeats: int = REPEATS, root: str | None = None) -> dict[str, Any]:
    """Seconds save_async blocks the caller vs the time of a sync save, medians.

    After each save_async the loop keeps training until the write commits, as
    the trainer does; the step time during the write goes to stderr, since on
    a small machine the writer thread competes with training for the cores.
    """
    model, opt = make_state()
    wait_for_quiet()
    blocked, sync_s, write_s, slowdowns = [], [], [], []
    with scratch(root) as tmp:
        mgr = CheckpointManager(tmp, "bench", 0, 1, "bench", keep_last=1)
        mgr.save(0, model, opt, rank_state={})  # warm-up
        step_s = _step_time(model, opt, 3)
        for i in range(1, repeats + 1):
            sync_s.append(mgr.save(2 * i - 1, model, opt, rank_state={}).blocked_s)
            mgr.wait_pruned()  # back to back here; in training, saves are many steps apart
            pending = mgr.save_async(2 * i, model, opt, rank_state={})
            blocked.append(pending.blocked_s)
            steps = 0
            t0 = time.perf_counter()
            while not pending.done():
                train_step(model, opt)
                steps += 1
            during = (time.perf_counter() - t0) / max(1, steps)
            info = pending.result()
            write_s.append(info.write_s)
            slowdowns.append(during / step_s)
            log(f"async {i}: blocked {pending.blocked_s:.3f}s, write {info.write_s:.3f}s, "
                f"sync save {sync_s[-1]:.3f}s; {steps} steps during the write at "
                f"{during:.3f}s/step (alone {step_s:.3f}s)")
    return {"blocked_s": median(blocked), "sync_save_s": median(sync_s), "write_s": median(write_s),
            "step_slowdown_during_write": median(slowdowns), "repeats": repeats,
            "ours_runs": blocked, "baseline_runs": sync_s}


# -- the object store -------------------------------------------------------

S3_BUCKET = "kcbench"
S3_ROOT = f"s3://{S3_BUCKET}/bench"  # CheckpointManager's root: objects under bench/<job_id>/
S3_BASELINE = f"{S3_BUCKET}/baseline"  # the baseline's objects


@contextlib.contextmanager
def s3_store(root: str | None = None) -> Iterator[Any]:
    """A local S3 server (tests/s3server.py: moto in a child process) with one bucket, this
    process's environment pointing at it (the operator's credentials, as `CheckpointManager`
    reads them), and node folders in a temporary folder under `root`.

    Yields the s3fs filesystem of kuangchao's own settings (platform/storage/objects.py).
    Afterwards the bucket is emptied and deleted, the server stopped, the environment
    restored and the temporary folder removed, whatever happened.
    """
    from kuangchao.platform.storage.objects import filesystem
    from tests.s3server import AWS_VARS_TO_CLEAR, S3Server  # the repo root is on sys.path

    with scratch(root) as tmp, S3Server() as s3:
        env = {**s3.admin_env(), "KC_NODE_DIR": str(tmp / "node"),
               "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
        with _environ(env, drop=AWS_VARS_TO_CLEAR):
            s3.create_bucket(S3_BUCKET)
            fs = filesystem("s3")
            try:
                yield fs
            finally:
                _empty_bucket(fs, s3)


@contextlib.contextmanager
def _environ(values: dict[str, str], drop: tuple[str, ...]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in (*values, *drop)}
    for k in drop:
        os.environ.pop(k, None)
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _empty_bucket(fs: Any, s3: Any) -> None:
    """Delete every object and the bucket (the server is stopped next anyway)."""
    try:
        client = s3.client("s3")
        keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=S3_BUCKET)
                for o in page.get("Contents", [])]
        for key in keys:
            client.delete_object(Bucket=S3_BUCKET, Key=key)
        client.delete_bucket(Bucket=S3_BUCKET)
        log(f"s3: deleted {len(keys)} objects and the bucket")
    except Exception as exc:  # the server goes away next; say so, do not mask the bench's error
        log(f"s3: could not empty bucket {S3_BUCKET}: {type(exc).__name__}: {exc}")


def _timed(into: list[float], fn: Any) -> Any:
    """`fn`, appending each call's seconds to `into` (where a save's time goes, for stderr)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t0)
    return run


def measure_s3_throughput(fs: Any, repeats: int = REPEATS) -> dict[str, Any]:
    """Sync save to the store, bytes/s, ours vs s3fs uploading the same objects; alternating.

    Ours: `CheckpointManager(S3_ROOT, ...).save` (world size 1, one process): DCP shards
    written and checksummed into this node's folder, fsynced, each uploaded as soon as it
    is closed (`put_file`, TRANSFER_THREADS threads), then the manifest: the commit. The retired
    checkpoint is deleted from the store on a background thread, waited for before the
    baseline. Baseline: the objects of our first checkpoint (its very bytes, read back
    once), put again under another prefix with one `fs.pipe({key: bytes})` call.
    """
    import s3fs

    from kuangchao.platform.storage.objects import filesystem

    model, opt = make_state()
    wait_for_quiet()
    mgr = CheckpointManager(S3_ROOT, "bench-sync", 0, 1, "bench", keep_last=1)
    assert mgr.remote is not None
    upload_s: list[float] = []
    commit_s: list[float] = []
    opened = mgr.remote.session

    def session(step: int, started: float) -> Any:
        # The shards upload as they close, during the write; what is timed here is
        # the wait for the uploads left once the write is over (and the rank file's).
        uploads = opened(step, started)
        uploads.finish = _timed(upload_s, uploads.finish)  # type: ignore[method-assign]
        return uploads

    mgr.remote.session = session  # type: ignore[method-assign]
    mgr.remote.commit = _timed(commit_s, mgr.remote.commit)  # type: ignore[method-assign]
    first = mgr.save(0, model, opt, rank_state={})  # warm-up: imports, planner, connections
    mgr.wait_pruned()
    step_key = first.path.removeprefix("s3://")
    objects = {e["name"].rsplit("/", 1)[-1]: fs.cat_file(e["name"])
               for e in fs.ls(step_key, detail=True) if e.get("type") != "directory"}
    payload = {f"{S3_BASELINE}/{name}": data for name, data in objects.items()}
    sizes = {name: len(data) for name, data in objects.items()}
    base = filesystem("s3")  # a pool of its own, with kuangchao's endpoint, timeouts and retries
    base.pipe(payload)  # warm-up of the baseline's connections
    log(f"s3 objects of one checkpoint: {sizes}")
    ours, theirs, total_s = [], [], []
    upload_s.clear()
    commit_s.clear()
    for i in range(1, repeats + 1):
        for side in ("ours", "s3fs") if i % 2 else ("s3fs", "ours"):
            if side == "ours":
                info = mgr.save(i, model, opt, rank_state={})
                ours.append(info.bytes / info.blocked_s)
                total_s.append(info.blocked_s)
                mgr.wait_pruned()  # the retired step's deletion must not slow the baseline
            else:
                t0 = time.perf_counter()
                base.pipe(payload)
                theirs.append(info_bytes(sizes) / (time.perf_counter() - t0))
        log(f"s3 save {i}: ours {info.bytes / 1e6:.1f} MB in {total_s[-1]:.3f}s (upload "
            f"{upload_s[-1]:.3f}s, manifest {commit_s[-1]:.3f}s), s3fs pipe "
            f"{info_bytes(sizes) / 1e6:.1f} MB in {info_bytes(sizes) / theirs[-1]:.3f}s")
    local_s = [t - u - c for t, u, c in zip(total_s, upload_s, commit_s, strict=True)]
    return {"ours_bytes_per_s": median(ours), "baseline_bytes_per_s": median(theirs),
            "bytes": info.bytes, "objects": sizes, "repeats": repeats,
            "ours_runs": ours, "baseline_runs": theirs, "save_s": median(total_s),
            "upload_s": median(upload_s), "manifest_s": median(commit_s),
            "local_s": median(local_s), "s3fs_version": s3fs.__version__,
            "max_concurrency": base.max_concurrency}


def info_bytes(sizes: dict[str, int]) -> int:
    """The bytes a checkpoint counts (CheckpointInfo.bytes): every file but the manifest."""
    return sum(n for name, n in sizes.items() if name != "manifest.json")


def measure_s3_async_blocked(repeats: int = REPEATS) -> dict[str, Any]:
    """The share of a save's wall time, from the call until the commit, the caller is blocked.

    Ours: `save_async` to the store, then `result()` (the caller does nothing else, so
    the wall time is the write's own, not stretched by training beside it).
    Baseline: the same share for a sync `save` of the same state (its blocked_s over the
    wall time of the call), measured the same way; the two alternate.
    """
    model, opt = make_state()
    wait_for_quiet()
    mgr = CheckpointManager(S3_ROOT, "bench-async", 0, 1, "bench", keep_last=1)
    mgr.save_async(0, model, opt, rank_state={}).result()  # warm-up (allocates the CPU copy)
    mgr.wait_pruned()
    ours, theirs, blocked, total = [], [], [], []
    step = 0
    for i in range(1, repeats + 1):
        for side in ("ours", "sync") if i % 2 else ("sync", "ours"):
            step += 1  # in the order saved: the store's pruning keeps the newest
            t0 = time.perf_counter()
            if side == "ours":
                pending = mgr.save_async(step, model, opt, rank_state={})
                pending.result()
                wall = time.perf_counter() - t0
                ours.append(pending.blocked_s / wall)
                blocked.append(pending.blocked_s)
                total.append(wall)
            else:
                info = mgr.save(step, model, opt, rank_state={})
                wall = time.perf_counter() - t0
                theirs.append(info.blocked_s / wall)
            mgr.wait_pruned()
        log(f"s3 async {i}: blocked {blocked[-1]:.3f}s of {total[-1]:.3f}s until committed "
            f"({ours[-1]:.3f}); sync save blocked {theirs[-1]:.3f} of its time")
    return {"blocked_fraction": median(ours), "sync_fraction": median(theirs),
            "blocked_s": median(blocked), "committed_s": median(total), "repeats": repeats,
            "ours_runs": ours, "baseline_runs": theirs}


def _step_time(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        train_step(model, opt)
    return (time.perf_counter() - t0) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--dir", default=None, help="Where to write (default: the temp folder).")
    parser.add_argument("--quick", action="store_true",
                        help="one repeat of each: checks the script works (seconds)")
    parser.add_argument("--skip-s3", action="store_true",
                        help="leave out the object-store lines (no local S3 server)")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 1
    warnings.filterwarnings("ignore", category=UserWarning)  # dcp's "assuming a single process"
    torch.set_num_threads(1)  # the trainer's default (training.torch_threads)
    with contextlib.redirect_stdout(sys.stderr):
        tp = measure_save_throughput(args.repeats, args.dir)
        ab = measure_async_blocked(args.repeats, args.dir)
    log(f"checkpoint {tp['bytes'] / 1e6:.1f} MB; async write {ab['write_s']:.3f}s, training steps "
        f"{ab['step_slowdown_during_write']:.2f}x slower while it runs")
    # Higher is better here: the target is a floor on ours / baseline (see README).
    emit("ckpt_io", "ckpt_save_throughput", "B/s", tp["ours_bytes_per_s"], tp["baseline_bytes_per_s"], 0.8,
         better="higher", target_on="ratio",
         spread={"ours": tp["ours_runs"], "baseline": tp["baseline_runs"]},
         settings="baseline: torch.save of the model and optimizer state_dicts into one file, "
                  "then fsync")
    emit("ckpt_io", "async_ckpt_blocked_fraction", "fraction", ab["blocked_s"], ab["sync_save_s"], 0.1,
         better="lower", target_on="ratio",
         spread={"ours": ab["ours_runs"], "baseline": ab["baseline_runs"]},
         settings="baseline: a synchronous CheckpointManager.save of the same state")
    if not args.skip_s3 and emit_s3(args.repeats, args.dir) != 0:
        sys.exit(1)


S3_LINES = (("s3_ckpt_throughput", "B/s", "higher", "ratio"),
            ("s3_async_blocked_fraction", "fraction", "lower", "ours"))


def emit_s3(repeats: int, root: str | None) -> int:
    """Measure and print the two object-store lines; 1 (and failed lines) when that broke."""
    try:
        with contextlib.redirect_stdout(sys.stderr), s3_store(root) as fs:
            s3tp = measure_s3_throughput(fs, repeats)
            s3ab = measure_s3_async_blocked(repeats)
    except Exception as exc:
        log(f"the object-store measurements failed:\n{traceback.format_exc()}")
        for metric, unit, better, on in S3_LINES:
            emit("ckpt_io", metric, unit, None, None, 0.8 if metric == "s3_ckpt_throughput" else 0.1,
                 better=better, target_on=on, error=f"{type(exc).__name__}: {exc}"[:500])
        return 1
    log(f"s3 save {s3tp['save_s']:.3f}s (medians): the local write (DCP shards, checksums, "
        f"fsync; shards uploading meanwhile) and clean-up {s3tp['local_s']:.3f}s, then waiting for "
        f"the uploads {s3tp['upload_s']:.3f}s, manifest "
        f"{s3tp['manifest_s']:.3f}s")
    objects = ", ".join(f"{n} {b / 1e6:.3g} MB" for n, b in s3tp["objects"].items())
    emit("ckpt_io", "s3_ckpt_throughput", "B/s", s3tp["ours_bytes_per_s"], s3tp["baseline_bytes_per_s"],
         0.8, better="higher", target_on="ratio",
         spread={"ours": s3tp["ours_runs"], "baseline": s3tp["baseline_runs"]},
         settings=f"baseline: s3fs {s3tp['s3fs_version']} S3FileSystem.pipe({{key: bytes}}) of our "
                  "checkpoint's objects (the same bytes, read back from it once) in one call, from "
                  "memory: s3fs's concurrent batch, default chunksize 50 MiB (each object under 2 "
                  "chunks: one PutObject each), max_concurrency "
                  f"{s3tp['max_concurrency']} (default); a filesystem of its own with kuangchao's "
                  "endpoint, timeouts (connect 5 s, read 15 s) and retries",
         notes=f"world size 1, one process; moto_server on 127.0.0.1 (tests/s3server.py); objects: "
               f"{objects}; our save's medians: {s3tp['save_s']:.3f}s = local write (shards, "
               f"checksums, fsync; each shard uploading from when it closes) and clean-up "
               f"{s3tp['local_s']:.3f}s + the wait for the uploads left "
               f"{s3tp['upload_s']:.3f}s + manifest {s3tp['manifest_s']:.3f}s")
    emit("ckpt_io", "s3_async_blocked_fraction", "fraction", s3ab["blocked_fraction"],
         s3ab["sync_fraction"], 0.1, better="lower", target_on="ours",
         spread={"ours": s3ab["ours_runs"], "baseline": s3ab["baseline_runs"]},
         settings="baseline: the same share for a synchronous CheckpointManager.save to the same "
                  "store (blocked for its whole time: 1 by construction, measured)",
         notes=f"world size 1, one process; blocked {s3ab['blocked_s']:.3f}s of "
               f"{s3ab['committed_s']:.3f}s from the save_async call until result() returned "
               "(the caller only waits meanwhile)")
    return 0


if __name__ == "__main__":
    main()
