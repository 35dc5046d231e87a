"""Sequence parallelism trains like one process.

Megatron's sequence parallelism (`parallel.sequence_parallel`) changes where
activations live and which collectives run (norms and dropout on sequence
shards; reduce-scatter and all-gather for each all-reduce), never the numbers:
each case runs the built-in model for a few steps on 4 real gloo ranks, through
the trainer's wiring (`Engine`, via tests/layouts/layout_run.py), and compares
the per-step global loss and gradient norm with single-process training on the
same global batch (rel 1e-5, fp32), as test_layouts.py does for the other
layouts.

The cases cover both built-in norms (GPT's LayerNorm with a bias, Llama's
RMSNorm), GPT's learned positions and tied head, the gradient of the norms
summed over the shards (with and without micro-batch accumulation), FSDP2 with
recompute, a pipeline whose stages pass sequence shards (Llama's rotary
tables then cover the whole sequence), and the mixture of experts with expert
parallelism. A checkpoint written under sequence parallelism resumes under
plain DDP.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.layouts.layout_run import STEPS, reference
from tests.layouts.test_layouts import (
    FP32,
    GPT,
    LLAMA,
    WORLD,
    _close,
    _doc,
    _reference_doc,
    _world,
    record,
)
from tests.layouts.test_moe_layouts import MOE

pytestmark = pytest.mark.timeout(1200)

SP = {"sequence_parallel": True}
CASES = {
    # The "tp2 with SP on llama" (2 replicas of it on the 4 ranks), accumulating.
    "dp2-tp2-sp-llama": ({"data_parallel_size": 2, "tensor_parallel_size": 2,
                          "gradient_accumulation_steps": 2, **SP}, LLAMA),
    "dp2-tp2-sp-gpt": ({"data_parallel_size": 2, "tensor_parallel_size": 2, **SP}, GPT),
    "tp4-sp-llama": ({"tensor_parallel_size": 4, **SP}, LLAMA),
    "tp4-sp-gpt": ({"tensor_parallel_size": 4, **SP}, GPT),
    "dp2-tp2-sp-zero3-recompute-gpt": ({"data_parallel_size": 2, "tensor_parallel_size": 2,
                                        "zero_stage": 3, "recompute": True, **SP}, GPT),
    "pp2-tp2-sp-llama": ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2,
                          "gradient_accumulation_steps": 2, **SP}, LLAMA),
    # The "ep2 x tp2 with SP": the experts see the whole sequence, gathered.
    "ep2-tp2-sp-moe": ({"data_parallel_size": 2, "tensor_parallel_size": 2,
                        "expert_parallel_size": 2, **SP}, MOE),
}
RESUME_AT = 3
PORTABLE = {  # whole run under the first layout, resumed at RESUME_AT under the second
    # (the same global batch: 2 replicas x 2 micro-batches, then 4 replicas x 1)
    "sp-to-ddp": ({"data_parallel_size": 2, "tensor_parallel_size": 2,
                   "gradient_accumulation_steps": 2, **SP}, {"data_parallel_size": 4}),
}


def layout_cases(work: Path, request: pytest.FixtureRequest) -> dict[str, dict]:
    """This module's cases, for the session's one batch (tests/layouts/conftest.py)."""
    cases = {name: {"doc": _doc(parallel, model)} for name, (parallel, model) in CASES.items()}
    for name, (first, second) in PORTABLE.items():
        ckpt = {"dir": str(work / f"ckpt-{name}"), "at": RESUME_AT}
        cases[f"{name}--whole"] = {"doc": _doc(first), "ckpt": ckpt}
        cases[f"{name}--resumed"] = {"doc": _doc(second), "ckpt": {**ckpt, "resume": True}}
    assert {_world(c["doc"]["parallel"]) for c in cases.values()} == {WORLD}
    return cases


@pytest.fixture(scope="module")
def results(layout_results) -> dict[str, dict]:
    return layout_results[__name__]


@pytest.mark.parametrize("name", list(CASES))
def test_sequence_parallel_layout_trains_like_one_process(name: str, results) -> None:
    parallel, model = CASES[name]
    got = record(results, name)
    want = reference(_reference_doc(_doc(parallel, model)))
    _close(got["losses"], want["losses"], FP32)
    _close(got["norms"], want["norms"], FP32 * 10)
    # The layout really ran sharded: the engine says so, and it is not the plain TP path.
    assert "sequence parallel" in got["describe"], got["describe"]
    if model is MOE:  # the same tokens routed, and dropped, as in one process
        assert got["moe"]["expert_load"] == want["moe"]["expert_load"]
        assert got["moe"]["dropped_tokens"] == want["moe"]["dropped_tokens"] > 0


def test_sequence_parallelism_keeps_under_0_6_of_the_activations_at_tp4():
    """bench/memory.py's measurement, small: the bytes autograd saves per rank in one
    forward pass, with and without sequence parallelism, on 4 gloo ranks."""
    from argparse import Namespace

    from bench.memory import measure

    got = measure(Namespace(seq=256, layers=2, d_model=128, heads=4))  # --quick's model
    for name, most in (("tp4", 0.6), ("tp2", 0.85)):
        sp, plain = got[f"{name}.sp"], got[f"{name}.tp"]
        assert sp["loss"] == pytest.approx(plain["loss"], rel=1e-6)
        assert sp["bytes"] / plain["bytes"] <= most, (name, sp, plain)


def _dropout_rank(rank: int, rendezvous: str, out: str) -> None:
    """One training forward and backward of a tp2 GPT with dropout under sequence
    parallelism; each rank writes its first residual dropout's mask and its RNG state."""
    import json
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from kuangchao.platform.spec.jobspec import validate_spec
    from kuangchao.workers.parallel.engine import Engine
    from kuangchao.workers.parallel.pipeline import lm_loss
    from kuangchao.workers.trainer.job_model import build_job_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        spec = validate_spec(_doc({"tensor_parallel_size": 2, **SP}, {**GPT, "dropout": 0.5}))
        torch.manual_seed(spec.training.seed)
        engine = Engine(spec, build_job_model(spec), rank=rank, world_size=2,
                        device=torch.device("cpu"))
        masks: list[list[bool]] = []
        drop = engine.chunks[0].blocks["0"].attn.resid_drop
        drop.register_forward_hook(lambda m, args, y: masks.append((y == 0).flatten().tolist()))
        x = torch.randint(0, GPT["vocab_size"], (2, GPT["seq_len"] + 1), generator=torch.Generator())
        lm_loss(engine.wrapped[0](x[:, :-1]), x[:, 1:]).backward()
        with open(f"{out}.{rank}", "w") as fh:
            json.dump({"mask": masks[0], "rng": torch.get_rng_state().tolist()}, fh)
        dist.barrier()  # both have written before either goes
    except BaseException:
        dist.destroy_process_group()
        raise
    # Not destroy_process_group: gloo torn down while the peer is already gone can abort
    # the process (SIGABRT), as layout_run.py's ranks avoid too.
    os._exit(0)


def test_dropout_on_the_shards_draws_each_ranks_own_mask(tmp_path):
    """Plain TP's ranks share one generator (a replicated tensor must drop the same
    entries everywhere); the shards' dropouts must not repeat one pattern, and the
    shared generator must stay in step across the group."""
    import json

    import torch.multiprocessing as mp

    mp.start_processes(_dropout_rank, args=(str(tmp_path / "rdv"), str(tmp_path / "out")), nprocs=2,
                       start_method="spawn")
    got = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)]
    a, b = got[0]["mask"], got[1]["mask"]
    assert len(a) == len(b) == 2 * (GPT["seq_len"] // 2) * GPT["d_model"]  # each a shard
    assert 0.3 < sum(a) / len(a) < 0.7 and a != b
    assert got[0]["rng"] == got[1]["rng"]


@pytest.mark.parametrize("name", list(PORTABLE))
def test_a_sequence_parallel_checkpoint_resumes_under_ddp(name: str, results) -> None:
    whole = record(results, f"{name}--whole")
    resumed = record(results, f"{name}--resumed")
    assert len(resumed["losses"]) == STEPS - RESUME_AT
    _close(resumed["losses"], whole["losses"][RESUME_AT:], FP32)
