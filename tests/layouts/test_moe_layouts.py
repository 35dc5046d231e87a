"""Layout equivalence for the mixture of experts (`model.type: moe`) and expert parallelism.

As tests/layouts/test_layouts.py (whose runner and helpers these cases share): each
layout trains the built-in MoE model a few steps on real gloo ranks, and its per-step
global loss and gradient norm must match single-process training on the same global
batch (rel 1e-5, fp32). The single process runs each step as the ranks do, one global
micro-batch at a time (`layout_run.micro_steps`), because expert capacity is counted
over the global micro-batch: with capacity factor 1 some tokens are dropped, and the
ranks must drop the very assignments the single process drops. Their routing
statistics (per-expert load, dropped tokens) must equal its too.

`ep2` runs on 2 of the 4 ranks (data_parallel_size 2, both expert-parallel); the
others on all 4. Checkpoints are layout-independent: every expert is saved under its
global index, so a run saved under one expert-parallel size resumes under another (and
under plain data parallelism) with the uninterrupted run's losses.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.layouts.layout_run import STEPS, reference
from tests.layouts.test_layouts import FP32, RESUME_AT, _close, _doc, _reference_doc, record

MOE = {"type": "moe", "n_layers": 2, "n_heads": 4, "d_model": 32, "seq_len": 16, "vocab_size": 64,
       "n_experts": 4, "top_k": 2, "capacity_factor": 1.0}
MOE4 = {**MOE, "n_layers": 4}  # two layers per pipeline stage
pytestmark = pytest.mark.timeout(1200)

CASES = {
    # name: (parallel, model, ranks, what the job log's layout line must show)
    "ep2": ({"data_parallel_size": 2, "expert_parallel_size": 2, "micro_batch_size": 4}, MOE, 2,
            "ep=2: experts 0-1 of 4"),
    "dp2-ep2": ({"data_parallel_size": 4, "expert_parallel_size": 2}, MOE, 4, "ep=2"),
    "ep4": ({"data_parallel_size": 4, "expert_parallel_size": 4}, MOE, 4, "ep=4: experts 0-0 of 4"),
    "pp2-ep2": ({"data_parallel_size": 2, "pipeline_parallel_size": 2, "expert_parallel_size": 2,
                 "gradient_accumulation_steps": 2}, MOE4, 4, "ep=2"),
    "ep2-tp2": ({"data_parallel_size": 2, "tensor_parallel_size": 2, "expert_parallel_size": 2},
                MOE, 4, "ep=2"),
    "ep2-accum2-recompute": ({"data_parallel_size": 2, "expert_parallel_size": 2,
                              "gradient_accumulation_steps": 2, "recompute": True}, MOE, 2, "ep=2"),
    "dp2-ep2-zero3": ({"data_parallel_size": 4, "expert_parallel_size": 2, "zero_stage": 3}, MOE, 4,
                      "ZeRO-3"),
    "ep4-zero2": ({"data_parallel_size": 4, "expert_parallel_size": 4, "zero_stage": 2}, MOE, 4,
                  "ZeRO-2"),
    "pp2-ep2-zero3": ({"data_parallel_size": 2, "pipeline_parallel_size": 2, "expert_parallel_size": 2,
                       "gradient_accumulation_steps": 2, "zero_stage": 3}, MOE4, 4, "ZeRO-3"),
    # Without expert parallelism: every rank holds every expert, capacity is still global.
    "dp4-ddp": ({"data_parallel_size": 4}, MOE, 4, "DDP"),
    "dp2-tp2": ({"data_parallel_size": 2, "tensor_parallel_size": 2}, MOE, 4, "manual all-reduce"),
}

PORTABLE = {
    # name: (first layout and its ranks, second layout and its ranks); same global batch.
    "ep2-to-ep4": (({"data_parallel_size": 2, "expert_parallel_size": 2, "micro_batch_size": 4}, 2),
                   ({"data_parallel_size": 4, "expert_parallel_size": 4}, 4)),
    "ep4-to-dp4": (({"data_parallel_size": 4, "expert_parallel_size": 4}, 4),
                   ({"data_parallel_size": 4}, 4)),
}


def layout_cases(work: Path, request: pytest.FixtureRequest) -> dict[str, dict]:
    """This module's cases, for the session's one batch (tests/layouts/conftest.py)."""
    cases = {name: {"doc": _doc(parallel, model), "world": ranks}
             for name, (parallel, model, ranks, _) in CASES.items()}
    for name, ((first, n1), (second, n2)) in PORTABLE.items():
        ckpt = {"dir": str(work / f"ckpt-{name}"), "at": RESUME_AT}
        cases[f"{name}--whole"] = {"doc": _doc(first, MOE), "world": n1, "ckpt": ckpt}
        cases[f"{name}--resumed"] = {"doc": _doc(second, MOE), "world": n2,
                                     "ckpt": {**ckpt, "resume": True}}
    return cases


@pytest.fixture(scope="module")
def results(layout_results) -> dict[str, dict]:
    return layout_results[__name__]


@pytest.mark.parametrize("name", list(CASES))
def test_moe_layout_trains_like_one_process(name: str, results: dict[str, dict]) -> None:
    parallel, model, _, shows = CASES[name]
    doc = _doc(parallel, model)
    got = record(results, name)
    want = reference(_reference_doc(doc))
    _close(got["losses"], want["losses"], FP32)
    _close(got["norms"], want["norms"], FP32 * 10)
    assert shows in got["describe"], got["describe"]
    if parallel.get("pipeline_parallel_size", 1) == 1:  # rank 0 runs every layer
        assert got["moe"]["expert_load"] == want["moe"]["expert_load"]
        assert got["moe"]["dropped_tokens"] == want["moe"]["dropped_tokens"] > 0
        assert got["moe"]["aux_loss"] == pytest.approx(want["moe"]["aux_loss"], rel=1e-5)


@pytest.mark.parametrize("name", list(PORTABLE))
def test_a_moe_checkpoint_resumes_under_another_expert_parallel_size(name: str,
                                                                    results: dict[str, dict]) -> None:
    whole = record(results, f"{name}--whole")
    resumed = record(results, f"{name}--resumed")
    assert len(resumed["losses"]) == STEPS - RESUME_AT
    _close(resumed["losses"], whole["losses"][RESUME_AT:], FP32)
    first = PORTABLE[name][0][0]
    want = reference(_reference_doc(_doc(first, MOE)))
    _close(whole["losses"], want["losses"], FP32)
