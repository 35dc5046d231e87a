"""Layout equivalence: every supported parallel layout trains like one process.

Each case runs the built-in model for a few steps on 4 real gloo ranks
(`layout_run.py`, through `kuangchao.workers.parallel.engine.Engine`, the wiring the
trainer uses), and compares the per-step global loss and gradient norm with
single-process training on the same global batch.

Tolerances, relative to the single-process loss:
* fp32 layouts: 1e-5. The sums run in another order (sharded matmuls, ring
  all-reduces), so the last bits differ, and Adam amplifies them a little.
* fp16/bf16 gradient compression and fp16/bf16 autocast: 2e-3, the rounding of
  a 10- or 7-bit mantissa over a few steps.
* PowerSGD (rank 1, exact for its first 2 steps): 1e-2; it is a lossy low-rank
  approximation by design, with error feedback.

All cases, with those of the other layout modules, run on one set of 4 rank
processes, one after another, each on a process group of its own: starting the
ranks (importing torch and transformers) is most of a case's cost here
(tests/layouts/conftest.py).

Checkpoints are layout-independent: one written under a layout resumes under
another with the same losses as the uninterrupted run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.layouts.layout_run import STEPS, reference

ROOT = Path(__file__).resolve().parents[2]
GPT = {"type": "gpt", "n_layers": 4, "n_heads": 4, "d_model": 32, "seq_len": 16, "vocab_size": 64}
LLAMA = {**GPT, "type": "llama"}
FP32, LOW, POWERSGD = 1e-5, 2e-3, 1e-2
# The module's first test also waits for the whole batch of cases to run.
pytestmark = pytest.mark.timeout(1200)


def _doc(parallel: dict, model: dict = GPT) -> dict:
    return {"model": model, "parallel": {"micro_batch_size": 2, **parallel},
            "optimizer": {"lr": 1e-2, "warmup_steps": 0, "schedule": "constant", "grad_clip": 1.0}}


WORLD = 4  # every case below runs on 4 ranks


def run_layouts(cases: dict[str, dict], workdir: Path) -> dict[str, dict]:
    """Run every case (in order) on one set of 4 gloo ranks; name -> rank 0's record.

    A case that failed maps to {"error": its ranks' tracebacks}, so only its own
    test fails.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "rendezvous").mkdir()
    batch = [{**case, "out": str(workdir / f"{name}.json")} for name, case in cases.items()]
    args = {"cases": batch, "world": WORLD, "rendezvous": str(workdir / "rendezvous")}
    proc = subprocess.run([sys.executable, "-m", "tests.layouts.layout_run", json.dumps(args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    results = {}
    for name, case in zip(cases, batch, strict=True):
        out = Path(case["out"])
        errors = sorted(workdir.glob(f"{name}.json.rank*.error"))
        if errors:
            results[name] = {"error": "\n".join(e.read_text() for e in errors)}
        elif out.exists():
            results[name] = json.loads(out.read_text())
            if case.get("logits"):  # each rank's step-0 logits error, where it held logits
                results[name]["logits"] = [json.loads(p.read_text())
                                           for p in sorted(workdir.glob(f"{name}.json.logits*"))]
        else:
            results[name] = {"error": f"no record (exit {proc.returncode}): {proc.stderr[-4000:]}"}
    return results


def record(results: dict[str, dict], name: str) -> dict:
    got = results[name]
    assert "error" not in got, f"{name} failed:\n{got['error'][-4000:]}"
    return got


def _reference_doc(doc: dict) -> dict:
    """The same model, optimizer and global batch on one rank."""
    p = doc["parallel"]
    dp = p.get("data_parallel_size", 1)
    keep = {k: p[k] for k in ("micro_batch_size", "gradient_accumulation_steps", "precision") if k in p}
    return {**doc, "parallel": {**keep, "data_parallel_size": dp}}


def _close(got: list[float], want: list[float], rtol: float) -> None:
    assert len(got) == len(want)
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    assert worst <= rtol, f"losses {got} differ from single-process {want} by {worst:.2e} > {rtol}"


CASES = {
    # name: (parallel, model, nodes, tolerance, what `wrapped` / `optimizer` must show)
    "dp4-ddp": ({"data_parallel_size": 4}, GPT, None, FP32, "DistributedDataParallel"),
    "dp4-zero1": ({"data_parallel_size": 4, "zero_stage": 1}, GPT, None, FP32,
                  "ZeroRedundancyOptimizer"),
    "dp4-zero2": ({"data_parallel_size": 4, "zero_stage": 2}, GPT, None, FP32, "FSDP"),
    "dp4-zero3": ({"data_parallel_size": 4, "zero_stage": 3}, GPT, None, FP32, "FSDP"),
    "dp4-zero3-offload": ({"data_parallel_size": 4, "zero_stage": 3, "offload": True}, GPT, None,
                          FP32, "FSDP"),
    "dp4-hierarchical": ({"data_parallel_size": 4, "hierarchical_allreduce": "on"}, GPT,
                         ["node-a", "node-a", "node-b", "node-b"], FP32, "hierarchy"),
    "dp4-fp16-compression": ({"data_parallel_size": 4, "grad_compression": "fp16"}, GPT, None, LOW,
                             "DistributedDataParallel"),
    "dp4-bf16-compression": ({"data_parallel_size": 4, "grad_compression": "bf16"}, GPT, None, LOW,
                             "DistributedDataParallel"),
    "dp4-powersgd": ({"data_parallel_size": 4, "grad_compression": "powersgd"}, GPT, None, POWERSGD,
                     "DistributedDataParallel"),
    "dp4-bf16": ({"data_parallel_size": 4, "precision": "bf16"}, GPT, None, LOW,
                 "DistributedDataParallel"),
    "dp4-fp16-loss-scaling": ({"data_parallel_size": 4, "precision": "fp16"}, GPT, None, LOW,
                              "DistributedDataParallel"),
    "dp4-accum2-recompute": ({"data_parallel_size": 4, "gradient_accumulation_steps": 2,
                              "recompute": True}, LLAMA, None, FP32, "DistributedDataParallel"),
    "dp2-tp2": ({"data_parallel_size": 2, "tensor_parallel_size": 2}, GPT, None, FP32, "ModelChunk"),
    "tp4-llama": ({"tensor_parallel_size": 4}, LLAMA, None, FP32, "ModelChunk"),
    "dp2-tp2-zero3-recompute": ({"data_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 3,
                                 "recompute": True}, GPT, None, FP32, "FSDP"),
    "dp2-pp2-1f1b": ({"data_parallel_size": 2, "pipeline_parallel_size": 2,
                      "gradient_accumulation_steps": 2}, GPT, None, FP32, "ModelChunk"),
    "dp2-pp2-gpipe-zero1": ({"data_parallel_size": 2, "pipeline_parallel_size": 2, "schedule": "gpipe",
                             "gradient_accumulation_steps": 2, "zero_stage": 1}, GPT, None, FP32,
                            "ZeroRedundancyOptimizer"),
    "dp2-pp2-interleaved": ({"data_parallel_size": 2, "pipeline_parallel_size": 2,
                             "schedule": "interleaved_1f1b", "virtual_stages": 2,
                             "gradient_accumulation_steps": 2}, GPT, None, FP32, "ModelChunk"),
    "dp2-pp2-zero3": ({"data_parallel_size": 2, "pipeline_parallel_size": 2, "zero_stage": 3,
                       "gradient_accumulation_steps": 2}, LLAMA, None, FP32, "FSDP"),
    "pp4-1f1b-llama": ({"pipeline_parallel_size": 4, "gradient_accumulation_steps": 4}, LLAMA, None,
                       FP32, "ModelChunk"),
    "pp2-tp2": ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2,
                 "gradient_accumulation_steps": 2}, GPT, None, FP32, "ModelChunk"),
    # HSDP: two sharding groups of 2 ranks, replicated across (FSDP2 over a 2-D mesh).
    "dp4-zero3-hsdp2": ({"data_parallel_size": 4, "zero_stage": 3, "shard_group_size": 2}, GPT,
                        None, FP32, "FSDP"),
    "dp4-zero2-hsdp2-accum2-recompute": ({"data_parallel_size": 4, "zero_stage": 2,
                                          "shard_group_size": 2, "gradient_accumulation_steps": 2,
                                          "recompute": True}, LLAMA, None, FP32, "FSDP"),
}


def _world(parallel: dict) -> int:
    return (parallel.get("data_parallel_size", 1) * parallel.get("tensor_parallel_size", 1)
            * parallel.get("pipeline_parallel_size", 1))


PORTABLE = {
    "ddp-to-pipeline": ({"data_parallel_size": 4},
                        {"data_parallel_size": 2, "pipeline_parallel_size": 2,
                         "gradient_accumulation_steps": 2}),
    "pipeline-to-ddp": ({"data_parallel_size": 2, "pipeline_parallel_size": 2,
                         "gradient_accumulation_steps": 2}, {"data_parallel_size": 4}),
    "zero1-to-tp-zero3": ({"data_parallel_size": 4, "zero_stage": 1},
                          {"data_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 3,
                           "gradient_accumulation_steps": 2}),
    "tp-to-zero1": ({"data_parallel_size": 2, "tensor_parallel_size": 2,
                     "gradient_accumulation_steps": 2}, {"data_parallel_size": 4, "zero_stage": 1}),
    # Shards replicated across two groups (and offloaded) are saved once and load as DDP's.
    "hsdp-offload-to-ddp": ({"data_parallel_size": 4, "zero_stage": 3, "shard_group_size": 2,
                             "offload": True}, {"data_parallel_size": 4}),
}
RESUME_AT = 3


def layout_cases(work: Path, request: pytest.FixtureRequest) -> dict[str, dict]:
    """Every case of this module, for the session's one batch (tests/layouts/conftest.py).

    The checkpoint cases go last: each whole run saves at RESUME_AT, and its
    resumed run under the other layout comes after it.
    """
    cases = {name: {"doc": _doc(parallel, model), "nodes": nodes}
             for name, (parallel, model, nodes, _, _) in CASES.items()}
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
def test_layout_trains_like_one_process(name: str, results: dict[str, dict]) -> None:
    parallel, model, nodes, rtol, shows = CASES[name]
    doc = _doc(parallel, model)
    got = record(results, name)
    want = reference(_reference_doc(doc))
    _close(got["losses"], want["losses"], rtol)
    _close(got["norms"], want["norms"], max(rtol, 1e-4) * 10)
    wiring = " ".join([*got["wrapped"], got["optimizer"], "hierarchy" if got["hierarchy"] else ""])
    assert shows in wiring, f"{name} was wired as {wiring}"
    if "hierarchical" not in name:
        assert not got["hierarchy"]
    if "hsdp" in name:  # sharded within each group of 2, replicated across the 2 groups
        assert got["placements"] == "(Replicate(), Shard(dim=0))", got["placements"]
        assert "HSDP: 2 sharding groups of 2 (ranks 0,1 | 2,3)" in got["describe"]


@pytest.mark.parametrize("name", list(PORTABLE))
def test_a_checkpoint_resumes_under_another_layout(name: str, results: dict[str, dict]) -> None:
    whole = record(results, f"{name}--whole")
    resumed = record(results, f"{name}--resumed")
    assert len(resumed["losses"]) == STEPS - RESUME_AT
    _close(resumed["losses"], whole["losses"][RESUME_AT:], FP32)
