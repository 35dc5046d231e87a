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

Run: .venv/bin/python bench/ckpt_io.py [--repeats 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
import warnings
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


if __name__ == "__main__":
    main()
