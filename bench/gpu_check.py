"""On one GPU, the CUDA and NCCL paths the CPU suite cannot reach (issue 25, item 7).

    python bench/gpu_check.py [--quick] [--json-out PATH]

For a bare GPU machine: the standard library and torch only (no Ray, Redis, pydantic or
kuangchao install), so each check is self-contained; the accelerator catalogue is parsed from
the checkout, not imported. Prints one JSON line per check, {"check", "ok", "detail",
"seconds"}, then a summary line. Exit 0: all passed; 1: one failed; 2: no CUDA device or no
torch. A watchdog ends the run at 210 s (every thread's traceback, exit 1), so a hung NCCL
call cannot outlast a 4-minute lease. Pass/fail checks, not bench/check.py result lines.
"""

from __future__ import annotations

import argparse
import ast
import copy
import faulthandler
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

try:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
except ImportError:  # reported by main() as "no torch", exit 2
    torch = None

HARDWARE = Path(__file__).resolve().parent.parent / "platform" / "cluster" / "hardware.py"
WATCHDOG_S = 210
# Dense bf16 peaks of parts the catalogue lacks, or whose PCIe/NVL variants clock lower than
# the SXM part it lists; matched first, in order, against torch's lower-cased device name.
# NVIDIA data sheets give bf16 with 2:4 sparsity, halved here: H100 PCIe 1513 -> 756 TFLOP/s,
# H100 NVL and H200 NVL 1671 -> 835; GB200 NVL72 360 PFLOP/s over 72 GPUs -> 2.5 PFLOP/s;
# HGX B200 36 PFLOP/s over 8 GPUs -> 2.25 PFLOP/s.
VARIANT_PEAKS = (("h100 pcie", 756e12), ("h100 nvl", 835e12), ("h200 nvl", 835e12),
                 ("gb200", 2.5e15), ("b200", 2.25e15))


def _number(node: ast.expr) -> float:
    if not all(isinstance(n, ast.Constant | ast.BinOp | ast.UnaryOp | ast.operator | ast.unaryop)
               for n in ast.walk(node)):
        raise ValueError(f"not a number literal: {ast.unparse(node)}")
    return float(eval(compile(ast.Expression(node), "hardware.py", "eval"), {"__builtins__": {}}))


def catalogue(path: Path = HARDWARE) -> dict[str, dict[str, float]]:
    """hardware.py's CATALOG as {key: {numeric keyword: value}}, read from its source: importing it
    needs the kuangchao package, which the GPU machine does not have."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Assign | ast.AnnAssign):
            continue
        target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
        if isinstance(target, ast.Name) and target.id == "CATALOG" and isinstance(node.value, ast.Dict):
            return {key.value: {kw.arg: _number(kw.value) for kw in call.keywords
                                if kw.arg in ("peak_flops", "mfu_ceiling")}
                    for key, call in zip(node.value.keys, node.value.values, strict=True)}
    raise ValueError(f"no CATALOG dict in {path}")


def peak_for(device_name: str, entries: dict[str, dict[str, float]]) -> tuple[dict[str, float], str]:
    """The data-sheet entry for a device name and where it came from; ({}, why) when unknown."""
    name = device_name.lower()
    for needle, peak in VARIANT_PEAKS:
        if needle in name:
            return {"peak_flops": peak}, f"data sheet ({needle})"
    for key, entry in entries.items():
        if key != "cpu" and key.split("-")[0] in name and "peak_flops" in entry:
            return entry, f"catalogue {key}"
    return {}, f"no peak known for {device_name!r}: add it to VARIANT_PEAKS or the catalogue"


def device_id(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    return str(uuid) if uuid is not None else f"{props.name}@pci{getattr(props, 'pci_bus_id', '?')}"


class Block(torch.nn.Module if torch else object):
    """A pre-norm transformer MLP block: the matmuls, norm and residual a training step runs."""

    def __init__(self, d: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def make_model(d: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(Block(d), Block(d), nn.Linear(d, d)).cuda()


def batch(d: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    return (torch.randn(16, 128, d, device="cuda", generator=gen),
            torch.randn(16, 128, d, device="cuda", generator=gen))


_PG: dict[str, Any] = {}


def process_group() -> None:
    """World size 1 on localhost, gloo for CPU tensors and NCCL for CUDA ones, as a rank runs
    (DCP's async save needs the CPU backend); one failure is reported by every check needing it."""
    if "error" in _PG:
        raise RuntimeError(f"process group failed earlier: {_PG['error']}")
    if dist.is_initialized():
        return
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
        torch.cuda.set_device(0)
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method="env://", rank=0, world_size=1,
                                timeout=timedelta(seconds=60), device_id=torch.device("cuda", 0))
    except Exception as exc:
        _PG["error"] = f"{type(exc).__name__}: {exc}"
        raise


def check_pinning(args) -> tuple[bool, Any]:
    """Ranks are pinned with CUDA_VISIBLE_DEVICES (workers/runtime/worker.py): a process started so
    must see exactly the GPU it was given, as its device 0, and none when given none."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [v.strip() for v in given.split(",")] if given else None  # the parent may be pinned too
    cases = {f"index {i}": (visible[i] if visible else str(i), device_id(i))
             for i in sorted({0, torch.cuda.device_count() - 1})}
    cases["empty"] = ("", None)
    children = {name: subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--identify"],
                                       env={**os.environ, "CUDA_VISIBLE_DEVICES": value},
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for name, (value, _) in cases.items()}
    seen, want = {}, {}
    for name, child in children.items():
        out, err = child.communicate(timeout=90)
        if child.returncode:
            raise RuntimeError(f"child with CUDA_VISIBLE_DEVICES={cases[name][0]!r} exited "
                               f"{child.returncode}: {err[-500:]}")
        seen[name] = json.loads(out.strip().splitlines()[-1])
        want[name] = {"count": 0 if cases[name][1] is None else 1, "id": cases[name][1]}
    return seen == want, {"want": want, "seen": seen}


def check_autocast(args) -> tuple[bool, Any]:
    """bf16 autocast must run the matmuls in bf16 while parameters, gradients and the loss stay fp32
    (the trainer's `precision: bf16`), and its loss must match an fp32 run's."""
    d = 256 if args.quick else 1024
    x, y = batch(d)
    ref = make_model(d)
    amp = copy.deepcopy(ref)
    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()
    out_dtypes: set[str] = set()
    for m in amp.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(lambda _m, _i, out: out_dtypes.add(str(out.dtype)))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = F.mse_loss(amp(x), y)
    loss.backward()
    grads = [p.grad for p in amp.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    ref_flat = torch.cat([p.grad.flatten() for p in ref.parameters()])
    cosine = F.cosine_similarity(flat, ref_flat, dim=0).item()
    rel = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    detail = {"matmul_out": sorted(out_dtypes), "loss_dtype": str(loss.dtype),
              "param_dtypes": sorted({str(p.dtype) for p in amp.parameters()}),
              "grad_dtypes": sorted({str(g.dtype) for g in grads}), "loss": loss.item(),
              "fp32_loss": ref_loss.item(), "loss_rel_diff": rel, "grad_cosine": cosine}
    # Loose on purpose: bf16 keeps 8 mantissa bits (~0.4% per rounding); the check is for a broken
    # autocast (NaN, fp16 overflow, a wrong cast), not bf16's own error.
    ok = (out_dtypes == {"torch.bfloat16"} and detail["param_dtypes"] == ["torch.float32"]
          and detail["grad_dtypes"] == ["torch.float32"] and loss.dtype == torch.float32
          and bool(torch.isfinite(flat).all()) and rel < 2e-2 and cosine > 0.99)
    return ok, detail


def check_fsdp_offload(args) -> tuple[bool, Any]:
    """FSDP2 with CPU offload (`parallel.offload`): sharded parameters, gradients and the optimizer
    live in pinned host memory and are copied to the GPU per block; the CPU suite cannot pin."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    process_group()
    d = 256 if args.quick else 1024
    model = make_model(d)
    kwargs = {"mesh": init_device_mesh("cuda", (1,)), "offload_policy": CPUOffloadPolicy(pin_memory=True),
              "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    for block in list(model)[:-1]:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = batch(d)
    losses, grad_devices = [], set()
    for _ in range(3 if args.quick else 6):
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        grad_devices |= {str(p.grad.to_local().device) for p in model.parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    shards = [p.to_local() for p in model.parameters()]
    detail = {"losses": losses, "param_devices": sorted({str(t.device) for t in shards}),
              "params_pinned": all(t.is_pinned() for t in shards), "grad_devices": sorted(grad_devices)}
    ok = (detail["param_devices"] == ["cpu"] and detail["params_pinned"] and grad_devices == {"cpu"}
          and all(map(math.isfinite, losses)) and losses[-1] < losses[0])
    return ok, detail


def _mismatches(want: Any, got: Any, path: str = "") -> list[str]:
    if isinstance(want, dict):
        if set(want) != set(got):
            return [f"{path}: keys {sorted(map(str, set(want) ^ set(got)))} differ"]
        return [m for k in want for m in _mismatches(want[k], got[k], f"{path}.{k}")]
    if isinstance(want, list | tuple):
        return [m for i, (a, b) in enumerate(zip(want, got, strict=True))
                for m in _mismatches(a, b, f"{path}[{i}]")]
    if isinstance(want, torch.Tensor):
        return [] if torch.equal(want.detach().cpu(), got.detach().cpu()) else [path]
    return [] if want == got else [path]


def check_async_checkpoint(args) -> tuple[bool, Any]:
    """An async save (`checkpoint.async_save`) copies model and optimizer state out of device memory
    while training goes on; the files must hold the state as it was at the save, bit for bit."""
    import inspect

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    process_group()
    d = 256 if args.quick else 1024
    x, y = batch(d)
    model = make_model(d)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    F.mse_loss(model(x), y).backward()  # a step first, so that the optimizer has state to save
    opt.step()
    opt.zero_grad()
    # The stager copies on its own CUDA stream, which does not wait for this one's pending update.
    torch.cuda.synchronize()
    msd, osd = get_state_dict(model, opt)
    want = copy.deepcopy({"model": msd, "optim": osd})
    kwargs, stager, how = {}, None, "default stager (synchronous copy to CPU, write on a thread)"
    if "async_stager" in inspect.signature(dcp.async_save).parameters:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                              use_async_staging=True, use_non_blocking_copy=True))
        kwargs, how = {"async_stager": stager}, "pinned host buffers, copied on a side stream"
    with tempfile.TemporaryDirectory() as folder:
        t0 = time.perf_counter()
        response = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=folder, **kwargs)
        returned_s = time.perf_counter() - t0
        staged = getattr(response, "staging_completion", None)
        written = getattr(response, "upload_completion", response)
        F.mse_loss(model(x), y).backward()  # reads the parameters only: may overlap the copy
        if staged is not None:
            staged.result(timeout=60)  # the update writes them: it waits for the copy
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        overlapped = not written.done()
        written.result(timeout=120)
        saved_s = time.perf_counter() - t0
        if stager is not None:
            stager.close()
        fresh = make_model(d, seed=1)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        fmsd, fosd = get_state_dict(fresh, fresh_opt)
        before = len(_mismatches(want["model"], fmsd))
        state = {"model": fmsd, "optim": fosd}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got_m, got_o = get_state_dict(fresh, fresh_opt)
    bad = _mismatches(want, {"model": got_m, "optim": got_o})
    moved = len(_mismatches(want["model"], get_state_dict(model, opt)[0]))
    detail = {"staging": how, "async_save_returned_s": round(returned_s, 4), "saved_s": round(saved_s, 3),
              "step_overlapped_write": overlapped, "mismatched": bad[:10],
              "fresh_model_differed_in": before, "trained_model_moved_in": moved}
    # A fresh model that already matched, or a step that changed nothing, would prove nothing.
    return not bad and before > 0 and moved > 0, detail


def check_nccl(args) -> tuple[bool, Any]:
    """NCCL on CUDA tensors: each collective the engines call, on an NCCL-only group and on the
    default mixed group. World size 1 makes each an identity, so outputs start as NaN: a
    collective that moved no data fails."""
    process_group()
    group = dist.new_group(ranks=[0], backend="nccl")
    n = 1 << (16 if args.quick else 22)
    x = torch.arange(n, device="cuda", dtype=torch.float32)
    results = {}
    for name, g in (("nccl", group), ("default", None)):
        t = x.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=g)
        results[f"{name}.all_reduce"] = torch.equal(t, x)
        t = x.bfloat16()
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=g, async_op=True).wait()  # AVG: NCCL's own
        results[f"{name}.all_reduce_avg_bf16_async"] = torch.equal(t, x.bfloat16())
        out = torch.full_like(x, float("nan"))
        dist.all_gather_into_tensor(out, x, group=g)
        results[f"{name}.all_gather_into_tensor"] = torch.equal(out, x)
        out = torch.full_like(x, float("nan"))
        dist.reduce_scatter_tensor(out, x, group=g)
        results[f"{name}.reduce_scatter_tensor"] = torch.equal(out, x)
        t = x.clone()
        dist.broadcast(t, src=0, group=g)
        results[f"{name}.broadcast"] = torch.equal(t, x)
        dist.barrier(group=g, device_ids=[0])
        results[f"{name}.barrier"] = True
    torch.cuda.synchronize()
    version = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
    detail = {"results": results, "group_backend": dist.get_backend(group),
              "nccl_version": ".".join(map(str, version)) if isinstance(version, tuple) else version}
    return all(results.values()) and detail["group_backend"] == "nccl", detail


def check_mfu(args) -> tuple[bool, Any]:
    """The catalogue's peak against this GPU: balancing weights ranks by `peak_flops * mfu_ceiling`,
    so a wrong peak misweights every mixed job. 8192^3 even in --quick: a smaller GEMM times
    launches and memory, not the tensor cores."""
    n, iters = 8192, (10 if args.quick else 40)
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(a)
    for _ in range(5):  # warm-up: cuBLAS picks its kernel, clocks ramp
        torch.mm(a, b, out=out)
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            torch.mm(a, b, out=out)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    achieved = 2 * n**3 / statistics.median(times)
    entry, source = peak_for(torch.cuda.get_device_name(0), catalogue())
    detail = {"achieved_tflops": round(achieved / 1e12, 1), "peak_source": source}
    if "peak_flops" not in entry:
        return False, detail
    detail |= {"peak_tflops": entry["peak_flops"] / 1e12, "mfu": round(achieved / entry["peak_flops"], 3),
               "catalogue_mfu_ceiling": entry.get("mfu_ceiling")}  # informative: speed_of() uses it
    # cuBLAS reaches ~60-85% of dense peak on a large square bf16 GEMM. Under 0.3: the peak is
    # too high for this part (a PCIe/NVL variant priced as SXM), the GPU is throttled or shared,
    # or the matmul left the tensor cores. Over 1.0 cannot happen: the peak is too low (a newer
    # part matched to an older entry) or the timing is wrong.
    return 0.3 <= detail["mfu"] <= 1.0, detail


CHECKS = (("cuda_visible_devices_pinning", check_pinning), ("bf16_autocast", check_autocast),
          ("fsdp2_cpu_offload_pinned", check_fsdp_offload),
          ("async_checkpoint_from_device", check_async_checkpoint),
          ("nccl_collectives_world_1", check_nccl), ("mfu_from_peak", check_mfu))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller models and fewer steps")
    parser.add_argument("--json-out", type=Path, help="also write every line to this file")
    parser.add_argument("--identify", action="store_true", help=argparse.SUPPRESS)  # check_pinning's child
    args = parser.parse_args(argv)
    if torch is None:
        print("gpu_check: torch is not installed; it needs a CUDA build of torch and a GPU", file=sys.stderr)
        return 2
    if args.identify:
        count = torch.cuda.device_count()
        print(json.dumps({"count": count, "id": device_id(0) if count else None}))
        return 0
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device: torch {torch.__version__} "
              f"({'CUDA ' + torch.version.cuda if torch.version.cuda else 'a CPU-only build'}), "
              f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}. Run it on a machine "
              "with an NVIDIA GPU and a CUDA build of torch.", file=sys.stderr)
        return 2
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
    sink = args.json_out.open("w") if args.json_out else None
    failed, t_all = [], time.perf_counter()

    def emit(line: dict) -> None:
        text = json.dumps(line, default=str)
        print(text, flush=True)
        if sink:
            sink.write(text + "\n")
            sink.flush()

    try:
        for name, check in CHECKS:
            t0 = time.perf_counter()
            try:
                ok, detail = check(args)
            except Exception as exc:  # one broken path must not hide the others
                ok, detail = False, f"{type(exc).__name__}: {exc}"[:2000]
            emit({"check": name, "ok": bool(ok), "detail": detail,
                  "seconds": round(time.perf_counter() - t0, 2)})
            failed += [] if ok else [name]
        emit({"summary": "gpu_check", "ok": not failed, "passed": len(CHECKS) - len(failed),
              "failed": failed, "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "cuda": torch.version.cuda, "quick": args.quick,
              "seconds": round(time.perf_counter() - t_all, 2)})
    finally:
        faulthandler.cancel_dump_traceback_later()
        if dist.is_initialized():
            dist.destroy_process_group()
        if sink:
            sink.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
