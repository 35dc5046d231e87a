"""A user's own model and data on the shared stack: a Hugging Face folder fine-tuned by the
built-in trainer, and by the user's own train function, through real faults.

The model is a tiny Llama-family folder (2 decoder layers, seeded weights, a BPE
tokenizer trained here) and the data a chat dataset and a jsonl one, all under the
stack's data root (tests/hf_fixtures.py).

- A rank SIGKILLed mid fine-tune: the job resumes at the exact sample and ends
  at the uninterrupted run's loss.
- examples/custom_hf_train.py (prepare_model, prepare_data, resume) survives a
  SIGKILL with the exact final loss, and resizes 2 -> 1 -> 2 live (it declares
  `live_resize`) with no sample lost or repeated (`data.record_samples`).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from kuangchao.platform.runtime.procs import alive
from tests.hf_fixtures import tiny_llama, write_datasets

from .conftest import Stack, wait_for
from .test_elastic import check_sample_record

pytestmark = pytest.mark.integration

DONE = {"SUCCEEDED", "FAILED", "CANCELLED"}
STEPS, INTERVAL = 200, 40


@pytest.fixture(scope="module")
def files(stack: Stack) -> dict[str, Path]:
    root = Path(stack.env["KC_HOME"]) / "data" / "own-model"
    return {"model": tiny_llama(root / "llama"), **write_datasets(root / "data")}


def doc(stack: Stack, name: str, files: dict[str, Path], **sections) -> dict:
    d = stack.job_doc(task={"name": name})
    d["model"] = {"type": "hf", "path": str(files["model"]), "seq_len": 64}
    d["data"] = {"path": str(files["chat"]), "format": "chat"}
    d["parallel"].update(micro_batch_size=2)
    d["training"].update(steps=STEPS, seed=5, log_interval=6)
    d["checkpoint"]["interval_steps"] = INTERVAL
    d.update(sections)
    return d


def own(stack: Stack, name: str, files: dict[str, Path], steps: int = STEPS, **elastic) -> dict:
    d = doc(stack, name, files, entrypoint="custom_hf_train:train")
    d["training"]["steps"] = steps
    d["data"] = {"path": str(files["jsonl"]), "format": "jsonl", "record_samples": True}
    if elastic:
        d["elastic"] = elastic
    return d


def kill_rank1_after(stack: Stack, job_id: str, step: int) -> dict:
    wait_for(lambda: stack.client.get(job_id)["progress"]["step"] > step, 600,
             f"job {job_id} to pass step {step}")
    rank1 = next(p for p in stack.client.get(job_id)["placement"] if p["rank"] == 1)
    assert alive(rank1["pid"])
    os.kill(rank1["pid"], signal.SIGKILL)
    return rank1


def finished(stack: Stack, job_id: str) -> dict:
    done = stack.wait_state(job_id, DONE, timeout=900)
    assert done["state"] == "SUCCEEDED", done["message"]
    return done


def test_a_sigkilled_rank_resumes_fine_tuning_at_the_exact_sample(stack, files):
    client = stack.client
    clean = client.submit(doc(stack, "hf-clean", files))
    # The checkpoint path: with a live resize the survivor would keep its work instead
    # (tests/integration/test_survivors.py), and nothing would be restored.
    victim = client.submit({**doc(stack, "hf-killed", files), "elastic": {"resize": "restart"}})
    own_clean = client.submit(own(stack, "own-clean", files))
    own_victim = client.submit(own(stack, "own-killed", files, resize="restart"))
    for job in (victim, own_victim):
        kill_rank1_after(stack, job["id"], INTERVAL + 5)
    for killed, reference in ((victim, clean), (own_victim, own_clean)):
        done, want = finished(stack, killed["id"]), finished(stack, reference["id"])
        assert done["restarts"] == 1 and want["restarts"] == 0
        resumed = done["restart_log"][0]["resumed_step"]
        assert resumed % INTERVAL == 0 and resumed >= INTERVAL
        assert done["progress"]["loss"] == pytest.approx(want["progress"]["loss"], rel=1e-6)
        restored = [r["message"] for r in client.logs(killed["id"])["logs"]
                    if "restored checkpoint" in r["message"]]
        assert any(f"at step {resumed}" in m for m in restored), restored
    # Each checkpoint of an HF job records the model, which export needs.
    from kuangchao.platform.protocol.checkpoint import read_manifest
    final = finished(stack, victim["id"])["checkpoints"][-1]
    assert read_manifest(final["path"])["model"]["kind"] == "hf"
    check_sample_record(stack, own_victim["id"], STEPS, 4)


def test_your_own_train_function_resizes_live_without_losing_a_sample(stack, files):
    client = stack.client
    # Open-ended, and cancelled once back at 2 replicas: a job of a few hundred steps can
    # finish at one replica while the new rank is still starting (importing transformers).
    job = client.submit(own(stack, "own-elastic", files, 100_000, min_replicas=1,
                            max_replicas=2, resize="live"))

    def at(replicas: int, after: int):
        j = client.get(job["id"])
        return j["state"] == "RUNNING" and j["replicas"] == replicas and \
            j["progress"]["step"] > after and j

    first = wait_for(lambda: at(2, 4), 600, "the job at 2 replicas")
    client.scale(job["id"], 1)
    shrunk = wait_for(lambda: at(1, first["progress"]["step"]), 600, "the job at 1 replica")
    client.scale(job["id"], 2)
    grown = wait_for(lambda: at(2, shrunk["progress"]["step"]), 600, "the job back at 2 replicas")
    client.cancel(job["id"])
    done = stack.wait_state(job["id"], DONE, timeout=300)
    assert done["state"] == "CANCELLED", done["message"]
    assert [(e["from"], e["to"]) for e in done["resize_log"]] == [(2, 1), (1, 2)]
    # Declared @supports("live_resize"): the survivors kept their processes and state.
    assert {e["path"] for e in done["resize_log"]} == {"live"} and done["restarts"] == 0
    # Every step up to one trained at 2 replicas again: once, at one size, on its block.
    assert check_sample_record(stack, job["id"], grown["progress"]["step"], 4,
                               complete=False) == {1, 2}
