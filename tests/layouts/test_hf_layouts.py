"""A Hugging Face model under every kind of layout: the same logits as transformers, and
the same training as one process.

A tiny Llama-family folder (2 decoder layers, grouped-query attention, seeded
random weights, a BPE tokenizer trained here: tests/hf_fixtures.py) is loaded by
4 real gloo ranks through the trainer's own wiring (`Engine`, via
tests/layouts/layout_run.py). Each case checks

* at step 0, the logits the layout computes against `transformers`' own forward
  of the folder (rel 1e-5, fp32): DDP, ZeRO-3, tensor parallelism (the config's
  `base_model_tp_plan`) and a 2-stage pipeline cut between decoder layers; and a
  GPT-2 folder, a family run whole (not cut), under ZeRO-3;
* then 5 steps of fine-tuning against single-process training on the same
  global batches, step by step (rel 1e-5, fp32), as test_layouts.py does for the
  built-in models.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.layouts.layout_run import reference
from tests.layouts.test_layouts import FP32, WORLD, _close, _reference_doc, record

pytestmark = pytest.mark.timeout(1200)

CASES = {
    "hf-dp4-ddp": {"data_parallel_size": 4},
    "hf-dp4-zero3": {"data_parallel_size": 4, "zero_stage": 3},
    "hf-dp2-tp2": {"data_parallel_size": 2, "tensor_parallel_size": 2},
    "hf-dp2-pp2": {"data_parallel_size": 2, "pipeline_parallel_size": 2,
                   "gradient_accumulation_steps": 2},
    "hf-tied-dp2-pp2": {"data_parallel_size": 2, "pipeline_parallel_size": 2,
                        "gradient_accumulation_steps": 2},
    # GPT-2 is no decoder of the cut layout: it runs whole, under ZeRO-3 per layer.
    "hf-gpt2-dp4-zero3": {"data_parallel_size": 4, "zero_stage": 3},
}


def _doc(folder: Path, parallel: dict) -> dict:
    return {"model": {"type": "hf", "path": str(folder), "seq_len": 32},
            "parallel": {"micro_batch_size": 2, **parallel},
            "optimizer": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant", "grad_clip": 1.0}}


@pytest.fixture(scope="module")
def folders(hf_folders) -> dict[str, Path]:
    return hf_folders


def _folder(name: str, folders: dict[str, Path]) -> Path:
    return folders["tied" if "tied" in name else "gpt2" if "gpt2" in name else "untied"]


def layout_cases(work: Path, request: pytest.FixtureRequest) -> dict[str, dict]:
    """This module's cases, for the session's one batch (tests/layouts/conftest.py)."""
    folders = request.getfixturevalue("hf_folders")
    return {name: {"doc": _doc(_folder(name, folders), par), "logits": True}
            for name, par in CASES.items()}


@pytest.fixture(scope="module")
def results(layout_results) -> dict[str, dict]:
    return layout_results[__name__]


@pytest.mark.parametrize("name", list(CASES))
def test_step_zero_logits_equal_transformers_forward(name: str, results, folders) -> None:
    got = record(results, name)
    assert got["logits"], f"{name}: no rank reported logits"
    for err in got["logits"]:
        assert err["max_abs"] <= FP32 * err["scale"], f"{name}: logits off by {err}"


@pytest.mark.parametrize("name", list(CASES))
def test_fine_tuning_matches_one_process(name: str, results, folders) -> None:
    got = record(results, name)
    want = reference(_reference_doc(_doc(_folder(name, folders), CASES[name])))
    _close(got["losses"], want["losses"], FP32)
    _close(got["norms"], want["norms"], FP32 * 10)
    assert WORLD == 4
