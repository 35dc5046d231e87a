"""A user's own train function, run by kuangchao with `entrypoint: custom_train:train`.

Submit it with the examples folder as the working directory, so every worker
can import this module (Ray's token authentication is on: present the token
`kc up` wrote):

    export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=~/.kuangchao/ray-token
    ray job submit --address http://127.0.0.1:8265 --working-dir examples -- \
        kc train --config custom-entrypoint.yaml
"""

import torch
from torch.nn.parallel import DistributedDataParallel


def train(ctx):
    """Fit y = 3x + 1 with DDP; kuangchao has already formed the process group."""
    torch.manual_seed(ctx.spec.training.seed)
    model = torch.nn.Linear(1, 1)
    ddp = DistributedDataParallel(model) if ctx.world_size > 1 else model
    opt = torch.optim.SGD(model.parameters(), lr=ctx.spec.optimizer.lr)
    gen = torch.Generator().manual_seed(ctx.spec.training.seed + ctx.rank)
    steps = ctx.spec.training.steps
    for step in range(1, steps + 1):
        x = torch.randn(32, 1, generator=gen)
        loss = torch.nn.functional.mse_loss(ddp(x), 3 * x + 1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.report(step, loss=loss.item())
    # kuangchao marks a job SUCCEEDED only once its final checkpoint is on disk.
    info = ctx.checkpoint.save(steps, model, opt, rank_state={"step": steps})
    ctx.log(f"learned w={model.weight.item():.3f} b={model.bias.item():.3f}")
    return {"final_loss": loss.item(), "checkpoint": info.to_json()}
