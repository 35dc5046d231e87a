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
