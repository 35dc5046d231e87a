"""The built-in trainer's checkpoints in one process: async periodic saves, a sync final one, resume."""

from pathlib import Path

import pytest
import torch

from kuangchao.platform.protocol.checkpoint import verify
from kuangchao.platform.spec.jobspec import load_spec_document, validate_spec
from kuangchao.workers.checkpoint.manager import CheckpointManager
from kuangchao.workers.runtime.context import TrainContext
from kuangchao.workers.runtime.joblog import JobLogSink
from kuangchao.workers.trainer.checkpoints import settles_checkpoints
from kuangchao.workers.trainer.loop import train

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
ROOT = Path(__file__).resolve().parents[2]


def context(tmp_path, steps, async_save=True):
    doc = load_spec_document(ROOT / "examples" / "tiny-gpt.yaml")
    doc["model"].update(n_layers=1, d_model=32, seq_len=16)
    doc["data"].update(max_bytes=20_000)
    doc["parallel"].update(data_parallel_size=1, micro_batch_size=2, gradient_accumulation_steps=1)
    doc["training"].update(steps=steps, log_interval=100)
    doc["checkpoint"].update(interval_steps=2, keep_last=10, path=str(tmp_path), async_save=async_save)
    spec = validate_spec(doc)
    mgr = CheckpointManager(tmp_path, "job-t", 0, 1, spec.spec_hash(), spec.checkpoint.keep_last)
    sink = JobLogSink(None, "job-t", 0, interval_s=60)
    ctx = TrainContext(job_id="job-t", rank=0, world_size=1, local_rank=0, spec=spec,
                       device=torch.device("cpu"), checkpoint=mgr, sink=sink)
    return ctx, sink


def messages(sink):
    with sink._lock:
        return [r["message"] for r in sink._buf]


def test_trainer_saves_periodic_checkpoints_in_the_background_and_resumes(tmp_path):
    ctx, sink = context(tmp_path, steps=5)
    out = train(ctx)
    assert ctx.checkpoint.pending is None  # nothing left in flight
    assert [p.name for p in ctx.checkpoint.list()] == ["step_00000002", "step_00000004", "step_00000005"]
    final = verify(out["checkpoint"]["path"])
    assert final["step"] == 5
    assert final["data_position"] == {"step": 5, "next_batch": 5, "skipped_batches": []}
    assert final["parallel"]["data_parallel_size"] == 1
    assert final["rng"]["kinds"] == ["torch", "numpy", "python"]
    log = messages(sink)
    assert any("writing in the background" in m for m in log)
    assert any("written in" in m and "in the background" in m for m in log)
    sink.close()
    # A longer run of the same job resumes from step 5, with the final save synchronous.
    ctx2, sink2 = context(tmp_path, steps=7, async_save=False)
    out2 = train(ctx2)
    assert out2["checkpoint"]["step"] == 7
    assert any("restored checkpoint" in m and "at step 5" in m for m in messages(sink2))
    assert not any("background" in m for m in messages(sink2))
    sink2.close()


def test_a_failing_train_function_still_settles_the_write_in_flight(tmp_path):
    ctx, sink = context(tmp_path, steps=5)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @settles_checkpoints
    def failing(ctx):
        ctx.checkpoint.save_async(1, model, opt, rank_state={})
        raise RuntimeError("a rank died")

    with pytest.raises(RuntimeError, match="a rank died"):  # the train function's error wins
        failing(ctx)
    assert ctx.checkpoint.pending is None
    assert verify(ctx.checkpoint.list()[-1])["step"] == 1
    sink.close()


def test_a_nan_loss_rolls_back_in_place_and_skips_its_batch(tmp_path):
    ctx, sink = context(tmp_path, steps=6, async_save=False)
    doc = ctx.spec.model_dump(mode="json")
    doc["fault_tolerance"]["inject_nan_at_batches"] = [3]
    ctx.spec = validate_spec(doc)
    out = train(ctx)
    assert out["steps"] == 6 and out["skipped_batches"] == [3]
    assert verify(out["checkpoint"]["path"])["data_position"]["skipped_batches"] == [3]
    log = messages(sink)
    assert any("rolled back to step 2" in m and "batch 3" in m for m in log)
    assert ctx.rollbacks == 1
    sink.close()


def test_numeric_faults_stop_after_max_restarts(tmp_path):
    from kuangchao.workers.errors import TrainingError

    ctx, sink = context(tmp_path, steps=6, async_save=False)
    doc = ctx.spec.model_dump(mode="json")
    doc["fault_tolerance"].update(inject_nan_at_batches=[1, 3], max_restarts=1)
    ctx.spec = validate_spec(doc)
    with pytest.raises(TrainingError, match="gave up"):
        train(ctx)
    sink.close()


def test_a_nan_before_the_first_checkpoint_restarts_from_the_initial_weights(tmp_path):
    ctx, sink = context(tmp_path, steps=4, async_save=False)
    doc = ctx.spec.model_dump(mode="json")
    doc["fault_tolerance"]["inject_nan_at_batches"] = [1]
    doc["checkpoint"]["interval_steps"] = 50  # nothing saved before the fault
    ctx.spec = validate_spec(doc)
    out = train(ctx)
    assert out["steps"] == 4 and out["skipped_batches"] == [1]
    assert any("rolled back to step 0" in m for m in messages(sink))
    sink.close()
