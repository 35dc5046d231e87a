"""Your own train function on the platform's calls, in one process (no Ray):
examples/custom_hf_train.py fine-tunes a tiny Hugging Face Llama through
ctx.prepare_model, ctx.prepare_data and ctx.resume.

- stopped at step 4 and started again, it ends at the loss of a run never stopped;
- a NaN injected at batch 4 rolls it back in place (it declared `numeric_guard`) to
  its last checkpoint, and the batch is skipped from then on;
- undeclared, the same fault fails the attempt instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kuangchao.platform.protocol.checkpoint import verify
from kuangchao.platform.spec.jobspec import validate_spec
from kuangchao.workers.checkpoint.manager import CheckpointManager
from kuangchao.workers.errors import NumericFault
from kuangchao.workers.runtime.context import TrainContext
from kuangchao.workers.runtime.joblog import JobLogSink
from kuangchao.workers.trainer.own import run_entrypoint
from tests.hf_fixtures import tiny_llama, write_datasets

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("own")
    return {"model": tiny_llama(root / "llama"), **write_datasets(root / "data", n=12)}


@pytest.fixture(autouse=True)
def data_root(files, monkeypatch):
    monkeypatch.setenv("KC_DATA_ROOTS", str(files["model"].parent))


@pytest.fixture(scope="module")
def train():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import custom_hf_train
        yield custom_hf_train.train
    finally:
        sys.path.remove(str(ROOT / "examples"))


def run(files, ckpt: Path, fn, steps: int, inject: tuple[int, ...] = ()) -> tuple[dict, list[str]]:
    spec = validate_spec({
        "model": {"type": "hf", "path": str(files["model"]), "seq_len": 32},
        "data": {"path": str(files["jsonl"]), "format": "jsonl"},
        "parallel": {"micro_batch_size": 2, "gradient_accumulation_steps": 2},
        "optimizer": {"lr": 1e-3}, "training": {"steps": steps, "seed": 3},
        "fault_tolerance": {"inject_nan_at_batches": list(inject)},
        "entrypoint": "custom_hf_train:train",
        "checkpoint": {"interval_steps": 3, "path": str(ckpt), "async_save": False}})
    sink = JobLogSink(None, "own", 0, interval_s=60)
    ctx = TrainContext(job_id="own", rank=0, world_size=1, local_rank=0, spec=spec,
                       device=torch.device("cpu"), accum_steps=2, sink=sink,
                       checkpoint=CheckpointManager(ckpt, "own", 0, 1, spec.spec_hash(), 5))
    try:
        return run_entrypoint(ctx, fn), [r["message"] for r in sink._buf]
    finally:
        sink.close()


def test_a_stopped_function_resumes_at_the_exact_loss(files, train, tmp_path):
    whole, _ = run(files, tmp_path / "whole", train, 6)
    run(files, tmp_path / "split", train, 4)
    resumed, log = run(files, tmp_path / "split", train, 6)
    assert any("restored checkpoint" in m and "at step 4" in m for m in log), log
    assert resumed["steps"] == whole["steps"] == 6
    assert resumed["final_loss"] == whole["final_loss"]


def test_a_numeric_fault_rolls_a_declared_function_back_and_skips_its_batch(files, train, tmp_path):
    out, log = run(files, tmp_path / "nan", train, 6, inject=(4,))
    assert out["steps"] == 6 and out["final_loss"] == out["final_loss"]  # finite
    assert any("numeric fault at step 5 (batch 4)" in m for m in log), log
    assert any("at step 3; skipping batches [4]" in m for m in log), log
    final = verify(tmp_path / "nan" / "own" / "step_00000006")
    assert final["data_position"] == {"step": 6, "next_batch": 7, "skipped_batches": [4]}


def test_an_undeclared_function_is_not_rolled_back(files, train, tmp_path):
    def undeclared(ctx):
        return train.__wrapped__(ctx) if hasattr(train, "__wrapped__") else train(ctx)

    with pytest.raises(NumericFault, match="batch 4"):
        run(files, tmp_path / "plain", undeclared, 6, inject=(4,))
