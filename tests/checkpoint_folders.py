"""A job's checkpoint folder for the `kc checkpoint` tests (unit and process tiers)."""

from pathlib import Path

import torch

from kuangchao.workers.checkpoint.manager import CheckpointManager
from kuangchao.workers.models.factory import ModelConfig, build_model

CFG = ModelConfig(type="gpt", n_layers=1, n_heads=2, d_model=16, seq_len=8, vocab_size=32)


def job_with_two_checkpoints(tmp_path: Path):
    """A job folder with checkpoints at steps 1 and 2, and the model of step 2."""
    torch.manual_seed(0)
    model = build_model(CFG)
    opt = torch.optim.AdamW(model.parameters())
    mgr = CheckpointManager(tmp_path / "ckpt", "job-1", 0, 1, "h")
    mgr.save(1, model, opt, rank_state={})
    with torch.no_grad():
        model.tok_emb.weight.add_(1.0)
    mgr.save(2, model, opt, rank_state={})
    return mgr.dir, model


def truncate_a_shard(step_dir: Path) -> None:
    shard = next(p for p in sorted(step_dir.iterdir()) if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:10])


def checkpoint_cli(*args: str):
    """`kc checkpoint ARGS` in-process. A refusal must be a clean exit with a
    message, never an exception escaping the command."""
    from typer.testing import CliRunner

    from kuangchao.api.cli.main import app

    result = CliRunner().invoke(app, ["checkpoint", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result
