"""An asynchronous checkpoint save while two gloo ranks (real processes) keep training."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from kuangchao.platform.protocol.checkpoint import verify
from kuangchao.platform.runtime.procs import free_port
from kuangchao.workers.checkpoint.manager import CheckpointManager, load_model_state
from kuangchao.workers.models.factory import ModelConfig, build_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _two_rank_worker(rank: int, port: int, root: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ddp = None
    try:
        torch.set_num_threads(1)
        cfg = ModelConfig(type="gpt", n_layers=2, n_heads=4, d_model=128, seq_len=16, vocab_size=256)
        torch.manual_seed(0)
        model = build_model(cfg)
        ddp = DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mgr = CheckpointManager(root, "job-2", rank, 2, "h", keep_last=3)

        def train_steps(n: int) -> None:
            for _ in range(n):
                x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
                _, loss = ddp(x, x)
                loss.backward()  # DDP all-reduces on the default group
                opt.step()
                opt.zero_grad(set_to_none=True)
                dist.all_reduce(torch.ones(1))

        train_steps(1)
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        pending = mgr.save_async(1, model, opt, rank_state={"rank": rank})
        train_steps(5)  # collectives on the default group while the write runs
        first = pending.result()
        mgr.save_async(6, model, opt, rank_state={"rank": rank})
        train_steps(2)
        final = mgr.save(8, model, opt, rank_state={"rank": rank})  # waits for step 6 first
        assert mgr._group is not None and mgr._group != dist.group.WORLD
        dist.barrier()
        if rank == 0:
            m = verify(first.path)
            assert m["world_size"] == 2 and {"rank_0.pt", "rank_1.pt"} <= set(m["files"])
            fresh = build_model(cfg)
            load_model_state(first.path, fresh)
            for k, v in fresh.state_dict().items():
                assert torch.equal(v, weights[k]), k
            assert verify(final.path)["step"] == 8
            assert [p.name for p in mgr.list()] == ["step_00000001", "step_00000006", "step_00000008"]
    finally:
        ddp = None  # the reducer before the group it holds (gloo's destructor can hang otherwise)
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_two_ranks_save_async_while_training_collectives_run(tmp_path):
    mp.spawn(_two_rank_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)


# -- save_async's state reading: get_state_dict with its setup kept ------------


# -- a peer lost after the group formed: the next save fails, it does not hang ----------

def _lost_peer_worker(rank: int, port: int, root: str, out: str) -> None:
    """Two ranks form a group (with a 5-minute timeout, as a rejoin's) and ready the
    checkpoint group at its top; rank 1 then dies, and rank 0 saves."""
    import json
    import os
    import time
    from datetime import timedelta

    from kuangchao.workers.errors import CheckpointError

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    model = build_model(ModelConfig(type="gpt", n_layers=1, n_heads=2, d_model=16, seq_len=8,
                                    vocab_size=32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = CheckpointManager(root, "job-lost", rank, 2, "h")
    mgr.prepare_group()
    dist.barrier()
    if rank == 1:
        os._exit(0)  # lost, as a SIGKILLed rank is, before the first save
    t0 = time.monotonic()  # whenever rank 1's sockets close, the save's collectives break
    try:
        mgr.save_async(1, model, opt, rank_state={}).result(timeout=120)
        outcome = "committed"
    except CheckpointError as exc:
        outcome = f"failed: {exc}"
    with open(out, "w") as fh:
        json.dump({"outcome": outcome, "seconds": time.monotonic() - t0}, fh)
    os._exit(0)  # gloo's teardown with a dead peer can hang


@pytest.mark.timeout(240)
def test_a_save_after_a_peer_died_fails_at_once_instead_of_waiting_for_it(tmp_path):
    """The checkpoint group is made at the top of the generation (`prepare_group`): the
    first save after a rank was lost runs collectives, which the lost peer breaks, and
    no rendezvous in the key-value store, which would wait for it until the timeout (a
    survivor stuck there never reaches the controller's next generation)."""
    import json

    ctx = mp.get_context("spawn")
    out = tmp_path / "rank0.json"
    port = free_port()
    procs = [ctx.Process(target=_lost_peer_worker, args=(r, port, str(tmp_path / "ckpt"), str(out)))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(150)
    alive = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not alive, "rank 0 still waits in its first save after its peer died"
    got = json.loads(out.read_text())
    assert got["outcome"].startswith("failed: "), got
    assert got["seconds"] < 60, got
