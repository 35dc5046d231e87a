"""`kc plan`: ranked layouts as text or JSON; bad input exits 2, no fit exits 1."""

from __future__ import annotations

import json
import re

from kuangchao.platform.planning import autoplan
from tests.process.test_cli_errors import ROOT, kc
from tests.unit.test_autoplan import auto_doc, cluster

CONTRACT = ["dp", "tp", "pp", "micro_batch", "zero_stage", "recompute", "schedule",
            "memory_gb_per_gpu", "predicted_step_s", "predicted_tflops_per_gpu"]


def test_plans_for_a_job_spec_as_json(tmp_path):
    out = kc("plan", "--model", str(ROOT / "examples/tiny-gpt.yaml"), "--gpus", "8", "--gpu",
             "a100-80gb", "--json", "--top", "5", tmp_home=tmp_path)
    assert out.returncode == 0, out.stderr
    plans = json.loads(out.stdout)
    assert 1 <= len(plans) <= 5 and list(plans[0])[:len(CONTRACT)] == CONTRACT
    assert all(p["dp"] * p["tp"] * p["pp"] == 8 for p in plans)
    steps = [p["predicted_step_s"] for p in plans]
    assert steps == sorted(steps)


def test_a_size_only_model_on_many_gpus_uses_tp_and_pp(tmp_path):
    model = tmp_path / "m.yaml"
    model.write_text("params: 175e9\nseq_len: 2048\nvocab_size: 51200\n")
    out = kc("plan", "--model", str(model), "--gpus", "1024", "--gpu", "h100-80gb",
             "--global-batch", "1536", "--top", "3", tmp_home=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "175B parameters (96 layers" in out.stdout
    assert out.stdout.count("\n") == 4
    # 175B does not fit data-parallel on 80 GB: the best plan cuts the model both ways.
    best = re.search(r"1\. dp=(\d+) tp=(\d+) pp=(\d+)", out.stdout)
    assert best and int(best[2]) > 1 and int(best[3]) > 1, out.stdout


def test_nothing_fits_exits_1_and_bad_input_exits_2(tmp_path):
    model = tmp_path / "m.yaml"
    model.write_text("params: 175e9\n")
    none = kc("plan", "--model", str(model), "--gpus", "8", "--gpu", "a100-40gb", tmp_home=tmp_path)
    assert none.returncode == 1 and "no layout fits" in none.stderr
    gpu = kc("plan", "--model", str(model), "--gpus", "8", "--gpu", "v100", tmp_home=tmp_path)
    assert gpu.returncode == 2 and "known: a100-40gb" in gpu.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {n_layers: 2, d_model: 30, n_heads: 4}\n")
    shape = kc("plan", "--model", str(bad), "--gpus", "8", tmp_home=tmp_path)
    assert shape.returncode == 2 and "d_model" in shape.stderr
    for out in (none, gpu, shape):
        assert "Traceback" not in out.stderr


def test_kc_plan_on_an_auto_spec_takes_its_global_batch_by_the_same_rule(tmp_path):
    import json

    import yaml

    spec = tmp_path / "auto.yaml"
    spec.write_text(yaml.safe_dump(auto_doc(micro_batch_size=2, gradient_accumulation_steps=3)))
    out = kc("plan", "--model", str(spec), "--gpus", "4", "--gpu", "cpu", "--top", "1",
             tmp_home=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "global batch 24" in out.stdout  # 2 x 3 x 4 ranks
    doc = auto_doc(gpus=4, global_batch=16)
    spec.write_text(yaml.safe_dump(doc))
    out = kc("plan", "--model", str(spec), "--gpus", "4", "--gpu", "cpu", "--gpus-per-node", "4",
             "--json", tmp_home=tmp_path)
    first = json.loads(out.stdout)[0]
    _, rec = autoplan.resolve(doc, cluster(4))
    assert (first["dp"], first["micro_batch"], first["num_microbatches"]) == (
        rec["dp"], rec["micro_batch"], rec["num_microbatches"])


def test_a_hugging_face_folder_or_its_config_json_is_planned_from_the_config(tmp_path):
    import yaml

    from tests.unit.test_autoplan import hf_folder

    folder = hf_folder(tmp_path)
    text = kc("plan", "--model", folder, "--gpus", "8", "--gpu", "h100-80gb", "--top", "2",
              tmp_home=tmp_path)
    assert text.returncode == 0, text.stderr
    assert "2.74M parameters (4 layers, d_model 256, 8 heads (2 key/value), seq 512)" in text.stdout
    as_json = kc("plan", "--model", f"{folder}/config.json", "--gpus", "8", "--gpu", "h100-80gb",
                 "--seq-len", "128", "--json", tmp_home=tmp_path)
    assert as_json.returncode == 0, as_json.stderr
    assert {p["tp"] for p in json.loads(as_json.stdout)} <= {1, 2}  # 2 key/value heads
    spec = tmp_path / "job.yaml"  # a job spec naming the folder is planned from it too
    spec.write_text(yaml.safe_dump({"model": {"type": "llama", "checkpoint": folder,
                                              "params": 2.7e6}}))
    job = kc("plan", "--model", str(spec), "--gpus", "8", "--gpu", "h100-80gb", "--top", "1",
             tmp_home=tmp_path)
    assert job.returncode == 0, job.stderr
    assert "2.74M parameters (4 layers" in job.stdout and "seq 128" in job.stdout
    missing = kc("plan", "--model", str(tmp_path), "--gpus", "8", tmp_home=tmp_path)
    assert missing.returncode == 2 and "config.json" in missing.stderr
    assert "Traceback" not in missing.stderr
