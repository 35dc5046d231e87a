"""`training.compile`: blocks run through torch.compile, or eagerly with a warning when it fails."""

from __future__ import annotations

import pytest
import torch

from kuangchao.platform.spec.jobspec import validate_spec
from kuangchao.workers.models.factory import build_model
from kuangchao.workers.parallel.engine import Engine
from kuangchao.workers.trainer.job_model import model_config
from tests.layouts.layout_run import global_batches, reference

DOC = {"model": {"type": "gpt", "n_layers": 2, "n_heads": 4, "d_model": 32, "seq_len": 16,
                 "vocab_size": 64},
       "parallel": {"micro_batch_size": 2},
       "optimizer": {"lr": 1e-2, "warmup_steps": 0, "schedule": "constant"}}
STEPS = 3


def _train(doc: dict) -> tuple[list[float], list[str], Engine]:
    spec = validate_spec(doc)
    torch.manual_seed(spec.training.seed)
    logs: list[str] = []
    engine = Engine(spec, build_model(model_config(spec)), rank=0, world_size=1,
                    device=torch.device("cpu"), log=lambda msg, **_: logs.append(msg))
    losses = []
    for batch in global_batches(spec, STEPS, spec.model.vocab_size):
        losses.append(engine.forward_backward([(batch[:, :-1], batch[:, 1:])]))
        engine.clip(spec.optimizer.grad_clip)
        engine.step()
    return losses, logs, engine


def _compiled(engine: Engine) -> bool:
    return all(getattr(b, "_compiled_call_impl", None) is not None
               for c in engine.chunks for b in c.blocks.values())


def test_compiled_blocks_train_like_eager_ones():
    want = reference(DOC, STEPS)["losses"]
    got, logs, engine = _train({**DOC, "training": {"compile": True}})
    assert logs == []
    assert _compiled(engine)
    assert got == pytest.approx(want, rel=1e-5)
    # Compiling in place keeps the checkpoint names.
    assert "blocks.0.attn.q_proj.weight" in engine.holder.state_dict()


def test_a_failed_compile_falls_back_to_eager_with_a_warning(monkeypatch):
    import torch._inductor.config as inductor

    torch._dynamo.reset()
    # No C++ compiler: inductor cannot build its CPU kernels.
    monkeypatch.setattr(inductor.cpp, "cxx", ("/nonexistent/c++",))
    got, logs, engine = _train({**DOC, "training": {"compile": True}})
    torch._dynamo.reset()
    assert len(logs) == 1 and "training.compile: torch.compile failed" in logs[0]
    assert "running eagerly" in logs[0]
    assert not _compiled(engine)
    assert got == pytest.approx(reference(DOC, STEPS)["losses"], rel=1e-6)
