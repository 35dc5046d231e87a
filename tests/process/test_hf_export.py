"""Hugging Face export and conversion of checkpoints, and `kc debug checkpoint` (issue 23).

A tiny HF Llama (tests/hf_fixtures.py) is checkpointed as the trainer does it:
wrapped as `tok_emb`, `blocks`, `norm`, `lm_head`, saved by a real
`CheckpointManager` with the manifest's "model" entry. What comes out of
`kc checkpoint export --format hf` must load with `from_pretrained` and compute
the same logits; conversions must round-trip tensor for tensor.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from typer.testing import CliRunner

from kuangchao.workers.checkpoint.manager import CheckpointManager
from kuangchao.workers.models import hf_names
from kuangchao.workers.models.factory import ModelConfig, build_model
from tests.checkpoint_folders import checkpoint_cli, job_with_two_checkpoints
from tests.hf_fixtures import tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def kc(*args: str):
    return checkpoint_cli(*args)


def kc_debug(*args: str):
    from kuangchao.api.cli.main import app

    result = CliRunner().invoke(app, ["debug", "checkpoint", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


class Wrapped(nn.Module):
    """The trainer's layout of an HF causal LM (the contract of issue 23)."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.tok_emb = hf.model.embed_tokens
        self.blocks = hf.model.layers
        self.norm = hf.model.norm
        self.lm_head = hf.lm_head


def load_hf(folder):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return (out.logits if hasattr(out, "logits") else out[0]).float()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("hf") / "tiny", tie=True)


@pytest.fixture(scope="module")
def hf_checkpoint(hf_folder, tmp_path_factory):
    """A step folder of the tiny HF Llama, written as the trainer writes one."""
    model = load_hf(hf_folder)
    wrapped = Wrapped(model)
    opt = torch.optim.AdamW(wrapped.parameters())
    mgr = CheckpointManager(tmp_path_factory.mktemp("ckpt"), "hf-job", 0, 1, "h")
    config = json.loads((hf_folder / "config.json").read_text())
    info = mgr.save(5, wrapped, opt, rank_state={}, extra={
        "model": {"kind": "hf", "config": config, "folder": str(hf_folder),
                  "tokenizer": str(hf_folder)},
        "parallel": {"data_parallel_size": 1}, "data_position": {"step": 5, "next_batch": 5}})
    return Path(info.path), model


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_sizes_parse():
    from kuangchao.api.cli.checkpoint import parse_size

    assert parse_size("5GB") == 5 * 10**9 and parse_size("512MiB") == 512 * 2**20
    assert parse_size("100KB") == 100_000 and parse_size("1000") == 1000 and parse_size("2g") == 2 * 10**9
    for bad in ("lots", "0", "-1MB", "5XB"):
        with pytest.raises(ValueError):
            parse_size(bad)


# -- names ------------------------------------------------------------------------

def test_names_map_both_ways_and_the_naming_is_told_from_the_names():
    assert hf_names.kc_to_hf("blocks.3.self_attn.q_proj.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_names.kc_to_hf("tok_emb.weight") == "model.embed_tokens.weight"
    assert hf_names.hf_to_kc("model.norm.weight") == "norm.weight"
    assert hf_names.hf_to_kc("lm_head.weight") == "lm_head.weight"
    assert hf_names.builtin_llama_to_hf("blocks.1.attn_norm.weight") == \
        "model.layers.1.input_layernorm.weight"
    assert hf_names.builtin_llama_to_hf("blocks.1.mlp_norm.weight") == \
        "model.layers.1.post_attention_layernorm.weight"
    assert hf_names.builtin_llama_to_hf("blocks.0.attn.o_proj.weight") == \
        "model.layers.0.self_attn.o_proj.weight"
    assert hf_names.hf_to_builtin_llama("model.layers.0.mlp.up_proj.weight") == "blocks.0.mlp.up_proj.weight"
    with pytest.raises(ValueError, match="transformer.h.0"):
        hf_names.hf_to_kc("transformer.h.0.attn.weight")
    with pytest.raises(ValueError):
        hf_names.builtin_llama_to_hf("blocks.0.self_attn.q_proj.weight")
    builtin = build_model(ModelConfig(type="llama", n_layers=1, n_heads=2, d_model=8, seq_len=4,
                                      vocab_size=16)).state_dict()
    assert hf_names.naming_of(builtin) == hf_names.BUILTIN_LLAMA
    assert hf_names.naming_of(["blocks.0.self_attn.q_proj.weight", "norm.weight"]) == hf_names.KC
    assert hf_names.naming_of(["model.layers.0.self_attn.q_proj.weight", "lm_head.weight"]) == hf_names.HF
    assert hf_names.naming_of(["transformer.wte.weight"]) == hf_names.HF  # the config check decides
    assert hf_names.naming_of([]) is None
    for d_model, d_ff in ((32, None), (96, None), (100, None), (64, 200)):
        cfg = ModelConfig(type="llama", n_layers=1, n_heads=2, d_model=d_model, seq_len=4,
                          vocab_size=16, d_ff=d_ff)
        assert hf_names.builtin_llama_ffn_dim(d_model, d_ff) == cfg.ffn_dim_for("llama")


# -- export --format hf ------------------------------------------------------------------

def test_export_hf_loads_with_from_pretrained_and_gives_the_same_logits(hf_checkpoint, hf_folder,
                                                                          tmp_path):
    from transformers import AutoTokenizer

    step, model = hf_checkpoint
    out = tmp_path / "exported"
    res = kc("export", str(step), "--format", "hf", "--out", str(out), "--max-shard-size", "100KB")
    assert res.exit_code == 0, res.stderr
    assert "step 5" in res.stdout and "tokenizer.json" in res.stdout
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, with the index
    assert "lm_head.weight" not in index["weight_map"]  # tied: written once, as save_pretrained does
    assert (out / "generation_config.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(load_hf(out), ids), logits(model, ids), rtol=1e-5, atol=1e-6)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("def f(): pass")["input_ids"] == AutoTokenizer.from_pretrained(hf_folder)(
        "def f(): pass")["input_ids"]


def test_export_hf_of_a_builtin_llama_computes_what_the_builtin_does(tmp_path):
    cfg = ModelConfig(type="llama", n_layers=2, n_heads=4, d_model=32, seq_len=16, vocab_size=64)
    torch.manual_seed(1)
    model = build_model(cfg).eval()
    mgr = CheckpointManager(tmp_path / "ckpt", "llama-job", 0, 1, "h")
    shape = {"kind": "builtin", "type": "llama", "n_layers": 2, "n_heads": 4, "d_model": 32,
             "vocab_size": 64, "seq_len": 16, "d_ff": None}
    info = mgr.save(2, model, torch.optim.SGD(model.parameters(), lr=0.1), rank_state={},
                    extra={"model": shape})
    out = tmp_path / "hf"
    res = kc("export", str(mgr.dir), "--format", "hf", "--out", str(out))
    assert res.exit_code == 0, res.stderr
    assert "no tokenizer" in res.stderr and "--tokenizer" in res.stderr  # a warning, not a failure
    config = json.loads((out / "config.json").read_text())
    assert config["intermediate_size"] == cfg.ffn_dim_for("llama") and config["num_key_value_heads"] == 4
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(logits(load_hf(out), ids), logits(model, ids), rtol=1e-5, atol=1e-6)
    assert Path(info.path).name == "step_00000002"


def test_export_hf_refuses_a_gpt_and_a_checkpoint_that_records_no_model(tmp_path):
    folder, model = job_with_two_checkpoints(tmp_path)  # written without "model"
    out = tmp_path / "hf"
    res = kc("export", str(folder), "--format", "hf", "--out", str(out))
    assert res.exit_code == 2 and 'no "model"' in res.stderr and "--config" in res.stderr
    assert not out.exists()
    mgr = CheckpointManager(tmp_path / "ckpt2", "gpt-job", 0, 1, "h")
    mgr.save(1, model, torch.optim.SGD(model.parameters(), lr=0.1), rank_state={},
             extra={"model": {"kind": "builtin", "type": "gpt", "n_layers": 1, "n_heads": 2,
                              "d_model": 16, "vocab_size": 32, "seq_len": 8, "d_ff": None}})
    res = kc("export", str(mgr.dir), "--format", "hf", "--out", str(out))
    assert res.exit_code == 2 and "no Hugging Face equivalent" in res.stderr and not out.exists()
    # The other formats work as before, "model" or not.
    assert kc("export", str(mgr.dir), "--out", str(tmp_path / "m.safetensors")).exit_code == 0


def test_export_hf_writes_nothing_when_it_fails_midway(hf_checkpoint, tmp_path, monkeypatch):
    from kuangchao.workers.checkpoint import hf_export

    step, _ = hf_checkpoint
    calls = []

    def failing(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))

    monkeypatch.setattr(hf_export, "save_safetensors", failing)
    out = tmp_path / "hf"
    res = kc("export", str(step), "--format", "hf", "--out", str(out), "--max-shard-size", "100KB")
    assert res.exit_code == 2 and "No space left" in res.stderr
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    res = kc("export", str(step), "--format", "hf", "--out", str(tmp_path / "full"))
    assert res.exit_code == 2 and "not empty" in res.stderr


# -- convert ----------------------------------------------------------------------------------

def test_hf_to_checkpoint_to_hf_gives_identical_tensors(hf_folder, tmp_path):
    res = kc("convert", str(hf_folder), "--out", str(tmp_path / "job"))
    assert res.exit_code == 0, res.stderr
    step = tmp_path / "job" / "step_00000000"
    assert kc("verify", str(step)).exit_code == 0
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["step"] == 0 and manifest["model"]["kind"] == "hf"
    assert manifest["model"]["config"]["model_type"] == "llama"
    assert manifest["model"]["tokenizer"] == str(hf_folder.resolve())
    from kuangchao.workers.checkpoint.export import read_model_tensors

    kc_tensors = read_model_tensors(step)  # the trainer's names, both ends of the tied pair
    assert "blocks.0.self_attn.q_proj.weight" in kc_tensors
    assert torch.equal(kc_tensors["lm_head.weight"], kc_tensors["tok_emb.weight"])
    back = tmp_path / "back"
    res = kc("convert", str(tmp_path / "job"), "--out", str(back), "--to", "hf")
    assert res.exit_code == 0, res.stderr
    original, again = tensors_of(hf_folder), tensors_of(back)
    assert set(original) == set(again)
    assert all(torch.equal(original[k], again[k]) for k in original)
    # A second conversion into the same job folder would overwrite its step 0: refused.
    res = kc("convert", str(hf_folder), "--out", str(tmp_path / "job"))
    assert res.exit_code == 2 and "exists" in res.stderr


def test_hf_to_safetensors_to_hf_needs_config_and_round_trips(hf_folder, tmp_path):
    flat = tmp_path / "flat.safetensors"
    assert kc("convert", str(hf_folder), "--out", str(flat)).exit_code == 0
    assert set(load_file(flat)) == set(tensors_of(hf_folder))  # the folder's own (HF) names
    res = kc("convert", str(flat), "--out", str(tmp_path / "no-config"))
    assert res.exit_code == 2 and "--config" in res.stderr and not (tmp_path / "no-config").exists()
    res = kc("convert", str(flat), "--out", str(tmp_path / "hf"), "--config",
             str(hf_folder / "config.json"), "--tokenizer", str(hf_folder))
    assert res.exit_code == 0, res.stderr
    original, again = tensors_of(hf_folder), tensors_of(tmp_path / "hf")
    assert set(original) == set(again) and all(torch.equal(original[k], again[k]) for k in original)
    assert (tmp_path / "hf" / "tokenizer.json").exists()
    # The other file format, and from a file of kuangchao's names into a checkpoint.
    pt = tmp_path / "flat.pt"
    assert kc("convert", str(flat), "--out", str(pt)).exit_code == 0
    kc_named = tmp_path / "kc.pt"
    torch.save({hf_names.hf_to_kc(k): v for k, v in torch.load(pt).items()}, kc_named)
    res = kc("convert", str(kc_named), "--out", str(tmp_path / "job"), "--to", "checkpoint",
             "--config", str(hf_folder))
    assert res.exit_code == 0, res.stderr
    assert kc("verify", str(tmp_path / "job")).exit_code == 0


def test_a_file_that_does_not_fit_the_config_is_refused_naming_the_tensor(hf_folder, tmp_path):
    tensors = tensors_of(hf_folder)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 64)
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad))
    res = kc("convert", str(bad), "--out", str(tmp_path / "hf"), "--config", str(hf_folder))
    assert res.exit_code == 2
    assert "model.layers.1.mlp.up_proj.weight has shape [3, 64]" in res.stderr and "[128, 64]" in res.stderr
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.7.mlp.up_proj.weight"] = torch.zeros(128, 64)
    save_file(tensors, str(bad))
    res = kc("convert", str(bad), "--out", str(tmp_path / "hf"), "--config", str(hf_folder))
    assert res.exit_code == 2
    assert "missing model.layers.1.mlp.up_proj.weight" in res.stderr
    assert "not in the model: model.layers.7.mlp.up_proj.weight" in res.stderr
    assert list(tmp_path.iterdir()) == [bad]
    save_file({"transformer.wte.weight": torch.zeros(2, 2)}, str(bad))
    res = kc("convert", str(bad), "--out", str(tmp_path / "hf"), "--config", str(hf_folder))
    assert res.exit_code == 2 and "transformer.wte.weight" in res.stderr


def test_a_checkpoint_without_a_model_entry_converts_with_config(hf_checkpoint, hf_folder, tmp_path):
    _, model = hf_checkpoint
    wrapped = Wrapped(model)
    mgr = CheckpointManager(tmp_path / "ckpt", "old", 0, 1, "h")
    mgr.save(1, wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1), rank_state={})
    res = kc("convert", str(mgr.dir), "--out", str(tmp_path / "hf"), "--config", str(hf_folder))
    assert res.exit_code == 0, res.stderr
    ids = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(logits(load_hf(tmp_path / "hf"), ids), logits(model, ids),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("src, args, message", [
    ("{ckpt}", ["--out", "{tmp}/c", "--to", "checkpoint"], "cannot convert a checkpoint to checkpoint"),
    ("{hf}", ["--out", "{tmp}/h", "--to", "hf"], "cannot convert a Hugging Face folder to hf"),
    ("{tmp}/notes.txt", ["--out", "{tmp}/h"], "is neither a checkpoint"),
    ("{tmp}/missing", ["--out", "{tmp}/h"], "does not exist"),
    ("{hf}", ["--out", "{tmp}/h", "--to", "onnx"], "unknown --to 'onnx'"),
    ("{hf}", ["--out", "{tmp}/h.safetensors", "--max-shard-size", "lots"], "not a size"),
    ("{hf}", ["--out", "{tmp}/job/step_00000009"], "a converted checkpoint is step 0"),
])
def test_convert_exits_2_on_bad_input(hf_checkpoint, hf_folder, tmp_path, src, args, message):
    (tmp_path / "notes.txt").write_text("x")
    fill = {"ckpt": hf_checkpoint[0], "hf": hf_folder, "tmp": tmp_path}
    res = kc("convert", src.format(**fill), *[a.format(**fill) for a in args])
    assert res.exit_code == 2 and message in res.stderr, res.stderr
    if "cannot convert" in message:
        assert "checkpoint -> hf, safetensors or torch" in res.stderr  # the ones that make sense


# -- kc debug checkpoint ------------------------------------------------------------------------

def test_debug_checkpoint_reports_metadata_and_flags_a_corrupt_and_a_missing_file(hf_checkpoint,
                                                                                   tmp_path):
    step = tmp_path / "step_00000005"
    shutil.copytree(hf_checkpoint[0], step)
    ok = kc_debug(str(step), "--json")
    assert ok.exit_code == 0, ok.stdout
    report = json.loads(ok.stdout)
    assert report["verified"] and report["step"] == 5 and report["world_size"] == 1
    assert report["model"]["kind"] == "hf" and report["parallel"] == {"data_parallel_size": 1}
    assert report["data_position"]["next_batch"] == 5 and report["torch_version"]
    assert report["tensors"]["model_tensors"] == 21 and report["tensors"]["optimizer_entries"] > 0
    assert {r["status"] for r in report["files"]} == {"ok"}
    text = kc_debug(str(step))
    assert text.exit_code == 0 and "Hugging Face llama" in text.stdout and "verified" in text.stdout

    shard = next(p for p in sorted(step.iterdir()) if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (step / "rank_0.pt").unlink()
    (step / "stray.bin").write_bytes(b"x")
    bad = kc_debug(str(step), "--json")
    assert bad.exit_code == 1
    status = {r["name"]: r["status"] for r in json.loads(bad.stdout)["files"]}
    assert status[shard.name] == "checksum_mismatch" and status["rank_0.pt"] == "missing"
    assert status["stray.bin"] == "unlisted" and status[".metadata"] == "ok"
    text = kc_debug(str(step))
    assert text.exit_code == 1 and "NOT VERIFIED: 3 problem(s)" in text.stdout
    assert "CHECKSUM_MISMATCH" in text.stdout and "MISSING" in text.stdout


def test_debug_checkpoint_exits_2_on_bad_input(tmp_path):
    out = kc_debug(str(tmp_path / "nope"))
    assert out.exit_code == 2 and "does not exist" in out.stderr
    (tmp_path / "empty").mkdir()
    out = kc_debug(str(tmp_path / "empty"))
    assert out.exit_code == 2 and "no checkpoints" in out.stderr
    partial = tmp_path / "job" / "step_00000003"
    partial.mkdir(parents=True)
    (partial / ".metadata").write_bytes(b"junk")
    out = kc_debug(str(tmp_path / "job"), "--json")
    assert out.exit_code == 1 and "partial" in json.loads(out.stdout)["problems"][0]
