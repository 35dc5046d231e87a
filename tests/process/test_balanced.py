"""Balanced work on real gloo ranks: uneven shares train like one process, and like an even split.

Two parts:

* the built-in trainer itself (`kuangchao.workers.trainer.loop.train`) on 2 ranks, one
  at full speed and one at emulated speed 0.5, `balance: speed` against `balance:
  even` (bench/hetero.py's runner): the fast rank takes more samples, every step
  trains on exactly its block, and the two loss curves agree at every step;
* the engine under each layout that balances (balanced_run.py, 4 ranks): DDP with
  ranks running different numbers of micro-batches, FSDP (ZeRO 2 and 3) with the
  same number, some empty, and a pipeline whose replicas run different numbers of
  micro-batches over a speed-balanced layer split; each matches single-process
  training on the same global batch. A checkpoint written under one layer split
  resumes under another.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.hetero import job_doc, loss_gap, run_cases
from tests.layouts.layout_run import STEPS, reference

ROOT = Path(__file__).resolve().parents[2]
GPT = {"type": "gpt", "n_layers": 4, "n_heads": 4, "d_model": 32, "seq_len": 16, "vocab_size": 64}
FP32 = 1e-5
pytestmark = [pytest.mark.timeout(900), pytest.mark.filterwarnings("ignore::UserWarning")]


def _spans(value: str) -> list[int]:
    return [i for span in value.split(",") for i in range(*map(int, span.split(":")))]


def test_the_trainer_balanced_by_speed_trains_the_even_splits_samples_to_its_losses(tmp_path):
    steps = 7
    cases = []
    for balance in ("even", "speed"):
        doc = job_doc("dp", balance, steps, str(tmp_path / balance))
        doc["model"].update(n_layers=2, d_model=64, seq_len=32)
        cases.append({"doc": doc, "speeds": [1.0, 0.5]})
    even, fast = run_cases(cases, tmp_path)
    assert "error" not in even, even["error"]
    assert "error" not in fast, fast["error"]
    # The speeds' split from the first step; the measured re-balance (a few steps in)
    # may move it by what a busy machine measures, never towards the slow rank.
    assert even["shares"] == [12, 12] and fast["shares"][0] > fast["shares"][1]
    assert [e["type"] for e in fast["events"]][:1] == ["rebalanced"]
    assert fast["events"][0]["new"] == [16, 8] and fast["events"][0]["cause"] == "speeds"
    assert even["events"] == []
    # Every step: the same 24 samples, each once; the fast rank took 16 of them.
    for step in range(steps):
        block = list(range(step * 24, (step + 1) * 24))
        for record in (even, fast):
            got = [_spans(record["samples"][f"{step}/2/{r}"]) for r in range(2)]
            assert sorted(got[0] + got[1]) == block
        took = len(_spans(fast["samples"][f"{step}/2/0"]))
        assert took == 16 if step < 3 else took > 12, (step, took)
    assert loss_gap(fast, even) <= FP32
    assert fast["final_loss"] == pytest.approx(even["final_loss"], rel=FP32)


def _doc(parallel: dict) -> dict:
    return {"model": GPT, "parallel": {"micro_batch_size": 2, **parallel},
            "optimizer": {"lr": 1e-2, "warmup_steps": 0, "schedule": "constant", "grad_clip": 1.0}}


PP = {"data_parallel_size": 2, "pipeline_parallel_size": 2, "gradient_accumulation_steps": 3}
CASES = {
    # name: (parallel, counts per replica, cut, layers per stage)
    "ddp-own-micro-batch-counts": ({"data_parallel_size": 4, "gradient_accumulation_steps": 2},
                                   (7, 5, 3, 1), "own", None),
    "zero2-common-with-empty": ({"data_parallel_size": 4, "zero_stage": 2}, (5, 1, 1, 1),
                                "common", None),
    "zero3-common": ({"data_parallel_size": 4, "zero_stage": 3}, (3, 2, 2, 1), "common", None),
    "pp2-dp2-units-split": (PP, (8, 4), "units", (3, 1)),
}


def _run(cases: dict[str, dict], work: Path) -> dict[str, dict]:
    (work / "rendezvous").mkdir(parents=True)
    batch = [{**c, "out": str(work / f"{name}.json")} for name, c in cases.items()]
    proc = subprocess.run([sys.executable, "-m", "tests.process.balanced_run",
                           json.dumps({"cases": batch, "world": 4,
                                       "rendezvous": str(work / "rendezvous")})],
                          cwd=ROOT, capture_output=True, text=True, timeout=800)
    out = {}
    for name, c in zip(cases, batch, strict=True):
        errors = sorted(work.glob(f"{name}.json.rank*.error"))
        if errors:
            out[name] = {"error": "\n".join(e.read_text() for e in errors)}
        elif Path(c["out"]).exists():
            out[name] = json.loads(Path(c["out"]).read_text())
        else:
            out[name] = {"error": f"no record (exit {proc.returncode}): {proc.stderr[-3000:]}"}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("balanced")
    cases = {name: {"doc": _doc(p), "counts": list(counts), "cut": cut, "split": split}
             for name, (p, counts, cut, split) in CASES.items()}
    # A checkpoint written with layers (3, 1) per stage resumes with (2, 2).
    ckpt = {"dir": str(work / "ckpt"), "at": 2}
    cases["split-save"] = {"doc": _doc(PP), "split": [3, 1], "ckpt": ckpt}
    cases["even-resume"] = {"doc": _doc(PP), "ckpt": {**ckpt, "resume": True}}
    return _run(cases, work)


def _close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    assert worst <= FP32, f"losses {got} differ from {want} by {worst:.2e}"


@pytest.mark.parametrize("name", list(CASES))
def test_uneven_shares_train_like_one_process(name: str, results: dict[str, dict]) -> None:
    parallel, counts, cut, split = CASES[name]
    got = results[name]
    assert "error" not in got, got["error"][-4000:]
    _close(got["losses"], reference(_doc(parallel) | {"parallel": {
        "micro_batch_size": 2, "data_parallel_size": parallel["data_parallel_size"],
        "gradient_accumulation_steps": parallel.get("gradient_accumulation_steps", 1)}})["losses"])
    sizes = {r["rank"]: r["sizes"] for r in got["ranks"]}
    if cut == "own":  # ranks run different numbers of micro-batches
        assert [len(sizes[r]) for r in range(4)] == [4, 3, 2, 1]
    if cut == "common":  # the same number everywhere (FSDP's gathers pair up), some empty
        assert len({len(s) for s in sizes.values()}) == 1
    if name == "zero2-common-with-empty":
        assert 0 in sizes[1]
    if split:
        blocks = {r["rank"]: r["blocks"] for r in got["ranks"]}
        assert blocks[0] == ["0", "1", "2"] and blocks[1] == ["3"]  # rank 1: stage 1 of replica 0
        assert "layers per stage [3, 1]" in got["describe"]


def test_a_checkpoint_resumes_under_another_layer_split(results: dict[str, dict]) -> None:
    whole, resumed = results["split-save"], results["even-resume"]
    assert "error" not in whole, whole["error"][-4000:]
    assert "error" not in resumed, resumed["error"][-4000:]
    assert len(resumed["losses"]) == STEPS - 2
    _close(resumed["losses"], whole["losses"][2:])
