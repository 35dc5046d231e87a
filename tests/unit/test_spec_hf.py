"""A Hugging Face model in the spec: the design documents' job as written, and every
way a model folder, tokenizer or data section can be wrong, each refused with the field
to change (config.json and tokenizer.json are written here as plain JSON: no torch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kuangchao.platform.errors import SpecError
from kuangchao.platform.security.admission import check_paths
from kuangchao.platform.spec.jobspec import validate_spec
from kuangchao.platform.spec.model import params_error
from kuangchao.platform.spec.model_folder import check_model_folder, folder_errors

from .test_api_edge import SPEC, api  # noqa: F401 -- the fixture

DESIGN_JOB = """
task: {name: llama3-8b-finetune, priority: high}
model: {type: llama, params: 8e9, checkpoint: /data/checkpoints/llama3-8b}
parallel: {data_parallel_size: 4, tensor_parallel_size: 2, pipeline_parallel_size: 2,
           micro_batch_size: 4, gradient_accumulation_steps: 8}
optimizer: {type: adamw, lr: 2e-5, weight_decay: 0.01}
permission:
  token_ttl_seconds: 3600
  audit_log: /var/log/kuangchao/audit.log
  allowed_interfaces: [all_reduce, all_gather, broadcast]
"""


def llama_folder(path: Path, *, model_type: str = "llama", heads: int = 8, kv: int = 2, layers: int = 4,
                 vocab: int = 512, tokenizer_ids: int = 512, weights: bool = True, **extra) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    arch = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel",
            "mistral": "MistralForCausalLM"}.get(model_type, "XForCausalLM")
    (path / "config.json").write_text(json.dumps({
        "model_type": model_type, "architectures": [arch], "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "hidden_size": 64,
        "vocab_size": vocab, "max_position_embeddings": 256, **extra}))
    if weights:
        (path / "model.safetensors").write_bytes(b"")
    (path / "tokenizer.json").write_text(json.dumps({
        "model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(tokenizer_ids - 2)}},
        "added_tokens": [{"id": tokenizer_ids - 2, "content": "<s>"},
                         {"id": tokenizer_ids - 1, "content": "</s>"}]}))
    return path


def errors(doc: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        validate_spec(doc)
    return dict(info.value.errors)


def folder_problems(doc: dict) -> dict[str, str]:
    return dict(folder_errors(validate_spec(doc)))


def test_the_design_documents_job_validates_as_written():
    import yaml

    spec = validate_spec(yaml.safe_load(DESIGN_JOB))
    assert spec.model.is_hf and spec.model.hf_folder == "/data/checkpoints/llama3-8b"
    assert spec.model.params == 8e9 and spec.task.priority_value == 100
    assert spec.permission.audit_log == "/var/log/kuangchao/audit.log"
    # allowed_interfaces is read as collectives; the pipeline brings its own send/recv.
    assert spec.permission.collectives == ["all_gather", "all_reduce", "broadcast", "recv", "send"]
    assert spec.world_size == 16


def test_allowed_interfaces_and_collectives_together_are_refused():
    errs = errors({"permission": {"collectives": ["all_reduce"], "allowed_interfaces": ["all_reduce"]}})
    assert "allowed_interfaces is another name for collectives" in errs["permission"]


def test_a_custom_function_gets_no_pipeline_collectives_it_did_not_list():
    spec = validate_spec({"entrypoint": "pkg.mod:fn", "parallel": {"pipeline_parallel_size": 2,
                                                                    "gradient_accumulation_steps": 2},
                          "model": {"n_layers": 2}, "permission": {"collectives": ["all_reduce"]}})
    assert spec.permission.collectives == ["all_reduce"]


def test_the_model_section_says_which_fields_a_hugging_face_model_takes():
    assert "model.path" in errors({"model": {"type": "hf"}})
    errs = errors({"model": {"type": "hf", "path": "/m", "n_layers": 8}})
    assert "comes from the model folder's config.json" in errs["model.n_layers"]
    errs = errors({"model": {"type": "gpt", "path": "/m", "params": 1e9}})
    assert "Hugging Face models only" in errs["model.path"] and "model.params" in errs
    assert "model.checkpoint" in errors({"model": {"type": "hf", "path": "/a", "checkpoint": "/b"}})


def test_the_data_section_needs_a_path_and_a_tokenizer_for_its_format():
    assert "data.path" in errors({"model": {"type": "hf", "path": "/m"}, "data": {"format": "jsonl"}})
    errs = errors({"data": {"path": "/d.jsonl", "format": "jsonl"}})
    assert "a built-in model has none of its own" in errs["data.tokenizer"]
    errs = errors({"model": {"type": "hf", "path": "/m"}, "training": {"eval_interval": 5}})
    assert "data.eval_fraction" in errs["training.eval_interval"]
    assert "data.format" in errors({"data": {"eval_fraction": 0.1}})["data.eval_fraction"]


def test_a_missing_model_folder_is_refused_naming_the_field(tmp_path):
    errs = folder_problems({"model": {"type": "hf", "path": str(tmp_path / "nope")}})
    assert "is not a folder" in errs["model.path"]
    (tmp_path / "empty").mkdir()
    errs = folder_problems({"model": {"type": "llama", "checkpoint": str(tmp_path / "empty")}})
    assert "holds no config.json" in errs["model.checkpoint"]
    folder = llama_folder(tmp_path / "noweights", weights=False)
    assert "holds no weights" in folder_problems({"model": {"type": "hf", "path": str(folder)}})["model.path"]
    assert folder_problems({"model": {"type": "hf", "path": str(folder), "pretrained": False}}) == {}


def test_what_a_model_cannot_take_is_refused_at_submission(tmp_path):
    gpt2 = llama_folder(tmp_path / "gpt2", model_type="gpt2")
    tp = {"tensor_parallel_size": 2}
    errs = folder_problems({"model": {"type": "hf", "path": str(gpt2)}, "parallel": tp})
    assert "runs with data parallelism and ZeRO" in errs["parallel.tensor_parallel_size"]
    errs = folder_problems({"model": {"type": "hf", "path": str(gpt2)},
                            "parallel": {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 2}})
    assert "a pipeline cuts" in errs["parallel.pipeline_parallel_size"]
    odd = llama_folder(tmp_path / "odd", heads=6, kv=3)
    listed = folder_errors(validate_spec({"model": {"type": "hf", "path": str(odd)},
                                          "parallel": {"tensor_parallel_size": 4}}))
    assert ("parallel.tensor_parallel_size", "4 does not divide the model's 6 attention heads") in listed
    assert ("parallel.tensor_parallel_size", "4 does not divide the model's 3 key/value heads") in listed
    llama = llama_folder(tmp_path / "llama")
    assert folder_problems({"model": {"type": "hf", "path": str(llama), "seq_len": 512}})["model.seq_len"]
    mistral = llama_folder(tmp_path / "mistral", model_type="mistral", sliding_window=32)
    errs = folder_problems({"model": {"type": "hf", "path": str(mistral), "seq_len": 64}})
    assert "sliding_window" in errs["model.seq_len"]
    errs = folder_problems({"model": {"type": "llama", "checkpoint": str(gpt2)}})
    assert "not a Llama-family one" in errs["model.checkpoint"]


def test_a_tokenizer_larger_than_the_embeddings_is_refused(tmp_path):
    big = llama_folder(tmp_path / "big", tokenizer_ids=600)
    errs = folder_problems({"model": {"type": "hf", "path": str(big)}})
    assert "vocabulary (600) exceeds the model's embeddings (512)" in errs["model.path"]
    tok = llama_folder(tmp_path / "tok", tokenizer_ids=513)
    fine = llama_folder(tmp_path / "fine")
    errs = folder_problems({"model": {"type": "hf", "path": str(fine)},
                            "data": {"tokenizer": str(tok), "path": "/d.txt", "format": "text"}})
    assert "exceeds" in errs["data.tokenizer"]


def test_model_params_more_than_ten_percent_off_names_both_numbers():
    assert params_error(8e9, 8_030_261_248) is None
    field, message = params_error(8e9, 130_000)
    assert field == "model.params" and "8e+09" in message and "130,000" in message


def test_the_model_folder_and_audit_log_must_lie_under_their_roots(tmp_path):
    data, ckpt, audit = (str(tmp_path / "data"),), (str(tmp_path),), (str(tmp_path / "audit"),)
    check_paths(None, str(tmp_path / "c"), data, ckpt, read_paths=(("model.path", str(tmp_path / "data/m")),),
                audit_log=str(tmp_path / "audit/job.log"), audit_roots=audit)
    with pytest.raises(SpecError) as info:
        check_paths(str(tmp_path / "data/*.jsonl"), str(tmp_path / "c"), data, ckpt,
                    read_paths=(("model.checkpoint", "/data/checkpoints/llama3-8b"),),
                    audit_log="/var/log/kuangchao/audit.log", audit_roots=audit)
    fields = dict(info.value.errors)
    assert set(fields) == {"model.checkpoint", "permission.audit_log"}
    assert "KC_AUDIT_ROOT" in fields["permission.audit_log"]


def test_the_check_at_submission_can_wait_for_the_ranks(tmp_path, monkeypatch):
    spec = validate_spec({"model": {"type": "hf", "path": str(tmp_path / "elsewhere")}})
    with pytest.raises(SpecError):
        check_model_folder(spec)
    monkeypatch.setenv("KC_MODEL_FOLDER_CHECK", "start")
    check_model_folder(spec)


def test_the_api_answers_a_bad_model_folder_with_422_and_stores_nothing(api, tmp_path):  # noqa: F811
    store, client, _ = api
    missing = {**SPEC, "model": {"type": "hf", "path": str(tmp_path / "data" / "missing")}}
    resp = client.post("/v1/jobs", json=missing)
    assert resp.status_code == 422 and "model.path" in resp.text and "is not a folder" in resp.text
    folder = llama_folder(tmp_path / "data" / "llama")
    resp = client.post("/v1/jobs?dry_run=true", json={**SPEC, "model": {"type": "hf", "path": str(folder)},
                                                      "parallel": {"tensor_parallel_size": 3}})
    assert resp.status_code == 422 and "parallel.tensor_parallel_size" in resp.text
    assert store.list() == []
    ok = client.post("/v1/jobs?dry_run=true", json={**SPEC, "model": {"type": "hf", "path": str(folder)}})
    assert ok.status_code == 200, ok.text


def test_data_whose_first_row_lacks_the_field_or_messages_is_refused_at_submission(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = llama_folder(tmp_path / "llama")
    (tmp_path / "docs.jsonl").write_text(json.dumps({"body": "x", "id": 1}) + "\n")
    (tmp_path / "chat.jsonl").write_text("\n" + json.dumps({"text": "hi"}) + "\n")
    pq.write_table(pa.table({"content": ["a"]}), tmp_path / "docs.parquet")
    model = {"type": "hf", "path": str(folder)}

    def refused(data: dict) -> dict[str, str]:
        with pytest.raises(SpecError) as info:
            check_model_folder(validate_spec({"model": model, "data": data}))
        return dict(info.value.errors)

    errs = refused({"path": str(tmp_path / "docs.jsonl"), "format": "jsonl"})
    assert "docs.jsonl:1: the rows have no 'text'; they have body, id" in errs["data.field"]
    errs = refused({"path": str(tmp_path / "*.parquet"), "format": "parquet", "field": "text"})
    assert "they have content" in errs["data.field"]
    errs = refused({"path": str(tmp_path / "chat.jsonl"), "format": "chat"})
    assert "chat.jsonl:2: a chat row needs `messages`" in errs["data.format"]
    check_model_folder(validate_spec({"model": model, "data": {
        "path": str(tmp_path / "docs.jsonl"), "format": "jsonl", "field": "body"}}))
