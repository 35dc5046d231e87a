"""Your own training loop for a Hugging Face model, with the whole platform behind it.

Run with `entrypoint: custom_hf_train:train` (examples/custom-hf.yaml), the
examples folder as the working directory, so every worker imports this module:

    export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=~/.kuangchao/ray-token
    ray job submit --address http://127.0.0.1:8265 --working-dir examples -- \\
        kc train --config custom-hf.yaml

What each call gives you (Ray Train's counterpart in brackets):
- ctx.prepare_model(model)   the spec's layout: DDP, ZeRO 1-3 (FSDP2 per decoder layer),
                             tensor parallelism from the model's own plan, recompute,
                             compile  [ray.train.torch.prepare_model]
- ctx.prepare_data()         this rank's share of the job's `data` section (or of any
                             map-style dataset you pass), in one global order that
                             survives restarts and resizes  [prepare_data_loader]
- ctx.resume(model, opt, sched)  the newest checkpoint that verifies: weights,
                             optimizer, LR schedule, data position, RNG; returns the
                             step to start at  [ray.train.get_checkpoint + your loading]
- ctx.check_numerics(...)    NaN/Inf and gradient spikes, before the optimizer step;
                             with @supports("numeric_guard") the job rolls back in place
- @supports("live_resize")   with elastic.resize: live, a resize keeps the survivors'
                             processes and state; the function runs again in the new group
- ctx.step_done(step, loss)  progress, checkpoints on the spec's interval and at the
                             end, preemption and resize requests  [ray.train.report]
"""

import torch
import torch.nn.functional as F

from kuangchao.workers.trainer.own import supports


@supports("numeric_guard", "live_resize")
def train(ctx):
    from transformers import AutoModelForCausalLM

    spec = ctx.spec
    torch.manual_seed(spec.training.seed)
    model = AutoModelForCausalLM.from_pretrained(spec.model.hf_folder, local_files_only=True,
                                                 dtype=torch.float32, attn_implementation="sdpa")
    model = ctx.prepare_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.optimizer.lr,
                            weight_decay=spec.optimizer.weight_decay)
    warmup = max(1, spec.optimizer.warmup_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    data = ctx.prepare_data()  # the spec's data: tokenized, packed, prompts masked
    done = ctx.resume(model, opt, sched)
    total = None
    while done < spec.training.steps:
        micro = data.step(done)
        total = 0.0
        for x, y in micro:
            logits = model(input_ids=x.to(ctx.device)).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.to(ctx.device).flatten(),
                                   ignore_index=-100)
            (loss / len(micro)).backward()
            total += float(loss.detach()) / len(micro)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.optimizer.grad_clip or 1e9)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2: a DTensor
        ctx.check_numerics(done, total, norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        done += 1
        if ctx.step_done(done, loss=total, lr=sched.get_last_lr()[0]):
            break
    return {"final_loss": total, "steps": done}
