"""Layout equivalence: every supported parallel layout trains like one process.

Each case runs the built-in model for a few steps on 4 real gloo ranks
(`layout_run.py`, through `kuangchao.workers.engine.Engine`, the wiring the
trainer uses), and compares the per-step global loss and gradient norm with
single-process training on the same global batch.

Tolerances, relative to the single-process loss:
* fp32 layouts: 1e-5. The sums run in another order (sharded matmuls, ring
  all-reduces), so the last bits differ, and Adam amplifies them a little.
* fp16/bf16 gradient compression and fp16/bf16 autocast: 2e-3, the rounding of
  a 10- or 7-bit mantissa over a few steps.
* PowerSGD (rank 1, exact for its first 2 steps): 1e-2; it is a lossy low-rank
  approximation by design, with error feedback.

Checkpoints are layout-independent: one written under a layout resumes under
another with the same losses as the uninterrupted run.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.layout_run import STEPS, reference

ROOT = Path(__file__).resolve().parents[2]
GPT = {"type": "gpt", "n_layers": 4, "n_heads": 4, "d_model": 32, "seq_len": 16, "vocab_size": 64}
LLAMA = {**GPT, "type": "llama"}
FP32, LOW, POWERSGD = 1e-5, 2e-3, 1e-2


def _doc(parallel: dict, model: dict = GPT) -> dict:
    return {"model": model, "parallel": {"micro_batch_size": 2, **parallel},
            "optimizer": {"lr": 1e-2, "warmup_steps": 0, "schedule": "constant", "grad_clip": 1.0}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(doc: dict, out: Path, nodes: list[str] | None = None, ckpt: dict | None = None
               ) -> dict:
    """Run layout_run.py on the layout's ranks and return rank 0's record."""
    p = doc["parallel"]
    world = (p.get("data_parallel_size", 1) * p.get("tensor_parallel_size", 1)
             * p.get("pipeline_parallel_size", 1))
    for attempt in range(2):
        args = {"doc": doc, "world": world, "port": _free_port(), "out": str(out),
                "nodes": nodes, "ckpt": ckpt}
        proc = subprocess.run([sys.executable, "-m", "tests.integration.layout_run", json.dumps(args)],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        # The free port can be taken between the probe and rank 0's bind: try another once.
        if proc.returncode != 0 and attempt == 0 and "address already in use" in proc.stderr.lower():
            continue
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(out.read_text())
    raise AssertionError("unreachable")


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
}


@pytest.mark.parametrize("name", list(CASES))
def test_layout_trains_like_one_process(name: str, tmp_path: Path) -> None:
    parallel, model, nodes, rtol, shows = CASES[name]
    doc = _doc(parallel, model)
    got = run_layout(doc, tmp_path / "out.json", nodes=nodes)
    want = reference(_reference_doc(doc))
    _close(got["losses"], want["losses"], rtol)
    _close(got["norms"], want["norms"], max(rtol, 1e-4) * 10)
    wiring = " ".join([*got["wrapped"], got["optimizer"], "hierarchy" if got["hierarchy"] else ""])
    assert shows in wiring, f"{name} was wired as {wiring}"
    if "hierarchical" not in name:
        assert not got["hierarchy"]


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
}


@pytest.mark.parametrize("name", list(PORTABLE))
def test_a_checkpoint_resumes_under_another_layout(name: str, tmp_path: Path) -> None:
    first, second = PORTABLE[name]
    ckpt = {"dir": str(tmp_path / "ckpt"), "at": 3}
    whole = run_layout(_doc(first), tmp_path / "a.json", ckpt=ckpt)
    resumed = run_layout(_doc(second), tmp_path / "b.json", ckpt={**ckpt, "resume": True})
    assert len(resumed["losses"]) == STEPS - 3
    _close(resumed["losses"], whole["losses"][3:], FP32)
