"""Your own model and data (issue 23): a Hugging Face model trained by kuangchao's
built-in trainer, its dataset preparation, and the design documents' 16-rank job.

  hf_step_time_ratio   seconds per optimizer step of a Hugging Face Llama (4 layers,
                       hidden 256, 2.6M parameters) fine-tuned on a tokenized jsonl
                       dataset, DDP on 2 ranks, fp32, gloo on CPU: kuangchao's
                       built-in trainer (a `model: {type: hf}` job through `kc up` +
                       `kc submit`, the job's `measured_step_s`) against Ray Train
                       v2's `TorchTrainer` + `prepare_model` running the equivalent
                       loop (bench/hf_rt.py) on the same stack. Lower is better;
                       target 1.03.
  tokenize_throughput  tokens/s of `load_tokenized` on a fresh cache against plain
                       `tokenizers` (bench/hf_tokenize.py). Higher is better: the
                       target 0.8 is a floor.
  tokenize_cache_hit_s a second `load_tokenized` of the same data (informative).
  design_job_16_ranks  (--design-job) the design documents' job, dp4 x tp2 x pp2 on
                       examples/cluster-4x8.yaml, 3 steps, must end SUCCEEDED;
                       ours = seconds from `kc submit` to SUCCEEDED, no baseline.

Run: .venv/bin/python bench/hf.py [--repeats 3] [--steps 150] [--design-job]
     (JSON lines on stdout, progress on stderr; see bench/README.md)
"""

from __future__ import annotations

import os

# Must precede any import of ray.train: selects the Train v2 API.
os.environ["RAY_TRAIN_V2_ENABLED"] = "1"

import argparse  # noqa: E402
import configparser  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import secrets  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` when run as a script

import yaml  # noqa: E402

from bench import harness  # noqa: E402
from bench.harness import REDIS_URL, REPO_ROOT, log, median  # noqa: E402

KC = str(Path(sys.executable).parent / "kc")
STEP_CLUSTER = REPO_ROOT / "examples" / "cluster-2x4.yaml"  # `kc up`'s default topology
DESIGN_CLUSTER = REPO_ROOT / "examples" / "cluster-4x8.yaml"
# The model and batch of hf_step_time_ratio: ~0.1 s of compute per step and rank.
LAYERS, HIDDEN, HEADS, KV_HEADS = 4, 256, 4, 2
SEQ_LEN, MICRO_BATCH, RANKS = 64, 4, 2
WARMUP_STEPS = 10  # steps left out of Ray Train's median (DDP's first buckets, allocator)
DONE = ("SUCCEEDED", "FAILED", "CANCELLED")

# The design documents' job (docs and /work/shared/design.md), as written there.
DESIGN_YAML = """\
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


# -- output --------------------------------------------------------------------------

def _clean(v: Any) -> Any:
    if isinstance(v, float):
        return round(v, 6) if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_clean(x) for x in v]
    return v


def emit_line(metric: str, unit: str, ours: Any, baseline: Any, target: Any, *,
              better: str, target_on: str, **extra: Any) -> None:
    """One result line through `harness.emit` (the contract of bench/check.py), extra
    fields rounded and made JSON-safe; it reaches the real stdout even when Ray writes to fd 1."""
    harness.emit("hf", metric, unit, ours, baseline, target, better=better, target_on=target_on,
                 **_clean(extra))


def emit_error(metric: str, unit: str, target: Any, exc: BaseException) -> None:
    better, on = _DIRECTION.get(metric, ("lower", "ratio"))
    emit_line(metric, unit, None, None, target, better=better, target_on=on,
              error=f"{type(exc).__name__}: {str(exc)[:2000]}")


# Which way each line is good, and what its target bounds.
_DIRECTION = {"tokenize_throughput": ("higher", "ratio"), "hf_step_time_ratio": ("lower", "ratio"),
              "design_job_16_ranks": ("lower", "state")}


# -- a stack: `kc up` with a temporary KC_HOME ---------------------------------------------

@dataclass
class Stack:
    root: Path  # scratch: KC_HOME is root/home
    env: dict[str, str]  # what every `kc` command of this stack runs with
    state: dict[str, Any]  # `kc up --json`
    client: Any  # kuangchao.api.sdk.client.Client with the admin key

    @property
    def home(self) -> Path:
        return Path(self.env["KC_HOME"])

    def kc(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run([KC, *args], capture_output=True, text=True, env=self.env,
                              timeout=timeout, cwd=REPO_ROOT)


def _redis_reachable(url: str) -> bool:
    import redis

    try:
        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
        return True
    except redis.RedisError:
        return False


def _admin_key(home: Path) -> str:
    parser = configparser.ConfigParser()
    parser.read(home / "credentials")
    return parser["default"]["api_key"]


@contextmanager
def kc_stack(cluster: Path, nodes: int | None = None) -> Iterator[Stack]:
    """`kc up --cluster cluster` with its own KC_HOME, Redis key prefix, free ports and
    cache folder (XDG_CACHE_HOME, where the built-in corpus is written); `kc down`,
    the prefix's keys deleted and the folder removed on the way out, whatever happens
    (the logs are kept, and named, when the block raised). `nodes`: only the cluster
    file's first `nodes` nodes (the quick mode's, whose 2 ranks fit on one)."""
    from kuangchao.api.sdk.client import Client

    root = Path(tempfile.mkdtemp(prefix="kcbench-hf-"))
    if nodes is not None:
        doc = yaml.safe_load(cluster.read_text())
        doc["nodes"] = doc["nodes"][:nodes]
        cluster = root / cluster.name
        cluster.write_text(yaml.safe_dump(doc, sort_keys=False))
    prefix = f"kcbench-hf-{secrets.token_hex(4)}:"
    env = {**os.environ, "KC_HOME": str(root / "home"), "KC_REDIS_PREFIX": prefix,
           "XDG_CACHE_HOME": str(root / "cache")}
    env.pop("KC_API_URL", None)
    if _redis_reachable(REDIS_URL):
        env["KC_REDIS_URL"] = REDIS_URL
    else:  # `kc up` starts a Redis of its own
        env.pop("KC_REDIS_URL", None)
    failed = False
    t0 = time.monotonic()
    up = subprocess.run([KC, "up", "--cluster", str(cluster), "--api-port", "0",
                         "--dashboard-port", "0", "--json"], capture_output=True, text=True,
                        env=env, timeout=900, cwd=REPO_ROOT)
    try:
        if up.returncode != 0:
            raise RuntimeError(f"kc up failed ({up.returncode}): {up.stderr.strip()[-2000:]}")
        state = json.loads(up.stdout)
        log(f"kc up --cluster {cluster.name} in {time.monotonic() - t0:.1f}s "
            f"(KC_HOME {env['KC_HOME']})")
        client = Client(state["api_url"], _admin_key(Path(env["KC_HOME"])))
        yield Stack(root, env, state, client)
    except BaseException:
        failed = True
        raise
    finally:
        down = subprocess.run([KC, "down"], capture_output=True, text=True, env=env,
                              timeout=300, cwd=REPO_ROOT)
        if down.returncode != 0:
            log(f"kc down failed ({down.returncode}): {down.stderr.strip()[-1000:]}")
        try:
            harness._delete_keys(prefix) if "KC_REDIS_URL" in env else None
        except Exception as exc:
            log(f"could not delete the keys of {prefix}: {exc}")
        if failed:
            log(f"logs kept in {root}/home/logs")
        else:
            shutil.rmtree(root, ignore_errors=True)


def submit(stack: Stack, doc: dict[str, Any], name: str, *sets: str) -> tuple[str, float]:
    """`kc submit job.yaml [--set ...] --json`; (job id, time.time() just before it)."""
    path = stack.root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    args = ["submit", str(path), "--json"]
    for s in sets:
        args += ["--set", s]
    t = time.time()
    out = stack.kc(*args)
    if out.returncode != 0:
        raise RuntimeError(f"kc submit failed ({out.returncode}): "
                           f"{(out.stderr or out.stdout).strip()[-2000:]}")
    return json.loads(out.stdout)["id"], t


def wait_done(stack: Stack, job_id: str, timeout_s: float, poll_s: float = 0.5) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        job = stack.client.get(job_id)
        if job["state"] != last:
            log(f"job {job_id}: {job['state']} (step {job['progress']['step']})")
            last = job["state"]
        if job["state"] in DONE:
            return dict(job)
        time.sleep(poll_s)
    raise TimeoutError(f"job {job_id} not finished within {timeout_s:.0f}s (state {last})")


def _job_failure(stack: Stack, job: dict[str, Any]) -> str:
    """The job's message and its last error lines, for an error line."""
    text = f"job {job['id']} ended {job['state']}: {job.get('message')}"
    try:
        logs = stack.client.logs(job["id"])["logs"]
        errors = [f"[rank {r.get('rank')}] {r['message']}" for r in logs
                  if r.get("level") in ("ERROR", "CRITICAL")]
        if errors:
            text += " | " + " | ".join(e[:600] for e in errors[-3:])
    except Exception:  # the message alone still says what failed
        pass
    return text


# -- hf_step_time_ratio ------------------------------------------------------------------

@dataclass
class StepFiles:
    model: Path
    jsonl: Path
    tokens: Path  # the tokenized cache's packed stream, which both sides train on
    params: int


def step_files(stack: Stack) -> StepFiles:
    """The model and dataset, under the stack's default data root ($KC_HOME/data)."""
    from kuangchao.workers.models.tiny_hf import tiny_llama, write_datasets

    root = stack.home / "data" / "hf"
    model = tiny_llama(root / "llama", layers=LAYERS, hidden=HIDDEN, heads=HEADS,
                       kv_heads=KV_HEADS)
    jsonl = write_datasets(root / "data")["jsonl"]
    # The cache the job's ranks will find (same file, tokenizer and settings: the same
    # key), built here once so that neither side's runs count it.
    from kuangchao.platform.spec.data import DataSection
    from kuangchao.workers.data.tokenized import load_tokenized

    td = load_tokenized(DataSection(path=str(jsonl), format="jsonl"), str(model), SEQ_LEN,
                        vocab_limit=None, roots=None, seed=0)
    log(f"dataset: {td.meta['documents']} documents, {td.meta['tokens']:,} tokens "
        f"({td.cache_dir})")
    return StepFiles(model, jsonl, td.cache_dir / "tokens.u32", param_count(model))


def param_count(folder: Path) -> int:
    from safetensors import safe_open

    n = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="np") as st:
            for k in st.keys():
                n += math.prod(st.get_slice(k).get_shape())
    return n


def kc_step_doc(files: StepFiles, steps: int, name: str) -> dict[str, Any]:
    """The job a user writes: everything not named here is kuangchao's default."""
    return {"task": {"name": name},
            "model": {"type": "hf", "path": str(files.model), "seq_len": SEQ_LEN},
            "data": {"path": str(files.jsonl), "format": "jsonl"},
            "parallel": {"data_parallel_size": RANKS, "micro_batch_size": MICRO_BATCH},
            "training": {"steps": steps}}


def defaults() -> dict[str, Any]:
    """The spec defaults the Ray Train loop copies (optimizer, threads, seed, log interval)."""
    from kuangchao.platform.spec.jobspec import JobSpec

    spec = JobSpec()
    o = spec.optimizer
    return {"optimizer": {"lr": o.lr, "betas": list(o.betas), "weight_decay": o.weight_decay,
                          "warmup_steps": o.warmup_steps, "min_lr_ratio": o.min_lr_ratio,
                          "grad_clip": o.grad_clip, "schedule": o.schedule},
            "threads": spec.training.torch_threads, "seed": spec.training.seed,
            "log_interval": spec.training.log_interval}


def run_kc(stack: Stack, files: StepFiles, steps: int, name: str) -> dict[str, Any]:
    job_id, t_submit = submit(stack, kc_step_doc(files, steps, name), name)
    job = wait_done(stack, job_id, timeout_s=900)
    if job["state"] != "SUCCEEDED":
        raise RuntimeError(_job_failure(stack, job))
    step_s = job.get("measured_step_s")
    if not isinstance(step_s, int | float):
        raise RuntimeError(f"job {job_id} has no measured_step_s: {job.get('measured_step_s')!r}")
    # The loss curve's points (every log_interval steps, stamped by rank 0): the mean step
    # time of each window after WARMUP_STEPS, a steady-state cross-check of the median.
    points = [p for p in stack.client.metrics(job_id)["points"] if p.get("ts")]
    windows = [(b["ts"] - a["ts"]) / (b["step"] - a["step"])
               for a, b in zip(points, points[1:], strict=False)
               if a["step"] >= WARMUP_STEPS and b["step"] > a["step"]]
    return {"step_s": float(step_s), "window_step_s": median(windows) if windows else None,
            "wall_s": (job.get("finished_at") or time.time()) - t_submit, "job": job_id}


def run_ray_train(stack: Stack, files: StepFiles, steps: int, name: str) -> dict[str, Any]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from bench.hf_rt import rt_loop

    out = stack.root / f"{name}.json"
    config = {"model": str(files.model), "tokens": str(files.tokens), "seq_len": SEQ_LEN,
              "micro_batch": MICRO_BATCH, "steps": steps, "out": str(out), **defaults()}
    trainer = TorchTrainer(
        rt_loop, train_loop_config=config,
        # 1 CPU per worker, as kuangchao's ranks (cpus_per_rank 1); no GPU (use_gpu would
        # pick NCCL); gloo, as kuangchao on CPU. The stack's head has no CPUs, so the
        # workers land on the topology's nodes, where kuangchao's ranks run.
        scaling_config=ScalingConfig(num_workers=RANKS, use_gpu=False,
                                     resources_per_worker={"CPU": 1}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(storage_path=str(stack.root / "ray-train"), name=name),
    )
    t0 = time.time()
    trainer.fit()  # raises when a worker fails
    stamps = json.loads(out.read_text())["steps"]
    steady = stamps[WARMUP_STEPS:]
    diffs = [b - a for a, b in zip(steady, steady[1:], strict=False)]
    every = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {"step_s": median(diffs), "all_steps_s": median(every), "wall_s": time.time() - t0}


def step_time(args: argparse.Namespace) -> None:
    import ray

    from kuangchao.platform.runtime.ray_connect import connect, ray_token_env

    # The quick mode starts one node of the two: both ranks of either side fit on it.
    with kc_stack(STEP_CLUSTER, nodes=1 if args.quick else None) as stack:
        files = step_files(stack)
        token_env = ray_token_env(stack.state)
        with harness._env(KC_HOME=str(stack.home), **token_env):
            os.environ.pop("RAY_AUTH_TOKEN", None)
            # Ray Train's workers import bench.hf_rt: the repository on their path.
            connect(stack.state["ray_address"], namespace="kcbench-hf",
                    runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}})
            try:
                ours, theirs = [], []
                for i in range(args.repeats):
                    order = ("kuangchao", "ray-train") if i % 2 == 0 else ("ray-train", "kuangchao")
                    for who in order:
                        harness.settle(60.0, quiet=not args.quick)  # quick: numbers mean nothing
                        if who == "kuangchao":
                            r = run_kc(stack, files, args.steps, f"bench-hf-{i}")
                            ours.append(r)
                            log(f"kuangchao#{i}: measured_step_s {r['step_s'] * 1000:.1f}ms, "
                                f"windows after step {WARMUP_STEPS} "
                                f"{(r['window_step_s'] or float('nan')) * 1000:.1f}ms, "
                                f"submit->SUCCEEDED {r['wall_s']:.1f}s")
                        else:
                            r = run_ray_train(stack, files, args.steps, f"hf-{i}")
                            theirs.append(r)
                            log(f"ray-train#{i}: step {r['step_s'] * 1000:.1f}ms (all steps "
                                f"{r['all_steps_s'] * 1000:.1f}ms), fit {r['wall_s']:.1f}s")
            finally:
                ray.shutdown()
    o, b = median([r["step_s"] for r in ours]), median([r["step_s"] for r in theirs])
    windows = [r["window_step_s"] for r in ours if r["window_step_s"]]
    d = defaults()
    emit_line("hf_step_time_ratio", "s", o, b, 1.03, better="lower", target_on="ratio",
              ours_runs=[r["step_s"] for r in ours], baseline_runs=[r["step_s"] for r in theirs],
              ours_steady_windows=median(windows) if windows else None,
              model=f"HF LlamaForCausalLM {LAYERS} layers, hidden {HIDDEN}, heads {HEADS}/"
                    f"{KV_HEADS} kv, vocab 512, {files.params:,} parameters, fp32",
              settings=f"{RANKS} ranks DDP, gloo on CPU, micro-batch {MICRO_BATCH}, seq_len "
                       f"{SEQ_LEN}, {args.steps} steps, {args.repeats} runs each, alternating; "
                       f"torch threads {d['threads']} both; Ray Train: TorchTrainer + "
                       "prepare_model (DDP defaults), ScalingConfig(num_workers=2, "
                       "use_gpu=False, resources_per_worker={CPU: 1}), TorchConfig(backend="
                       "gloo), AdamW/warmup-cosine/grad_clip as the spec's defaults, "
                       f"ray.train.report every {d['log_interval']} steps; median of steps "
                       f"after {WARMUP_STEPS}. Ours: the job's measured_step_s (rank 0's "
                       "median step), every other setting kuangchao's default",
              notes="ratio = ours / baseline, lower is better; met when ratio <= 1.03")


# -- design_job_16_ranks -------------------------------------------------------------------

def design_job(args: argparse.Namespace) -> bool:
    """Run the job; True when it SUCCEEDED (its line is printed either way)."""
    from kuangchao.workers.models.tiny_hf import tiny_llama

    with kc_stack(DESIGN_CLUSTER) as stack:
        folder = tiny_llama(stack.home / "data" / "llama3-tiny", layers=4, hidden=64, heads=4,
                            kv_heads=2)
        params = param_count(folder)
        doc = yaml.safe_load(DESIGN_YAML)
        doc["model"].update(checkpoint=str(folder), params=float(params))
        # The operator's roots force this one: audit files must lie under $KC_HOME/audit.
        doc["permission"]["audit_log"] = str(stack.home / "audit" / "audit.log")
        job_id, t0 = submit(stack, doc, "design-job", f"training.steps={args.design_steps}")
        log(f"design job {job_id} submitted ({params:,} parameters, 16 ranks)")
        job = wait_done(stack, job_id, timeout_s=args.design_timeout, poll_s=1.0)
        wall = time.time() - t0
        extra: dict[str, Any] = {}
        if job["state"] != "SUCCEEDED":
            extra["error"] = _job_failure(stack, job)
        audit = Path(doc["permission"]["audit_log"])
        emit_line("design_job_16_ranks", "s", wall, None, "SUCCEEDED", better="lower",
                  target_on="state", state=job["state"],
                  job=job_id, world_size=job.get("world_size"),
                  steps=job["progress"]["step"], loss=job["progress"].get("loss"),
                  measured_step_s=job.get("measured_step_s"),
                  audit_records=_count_lines(audit), params=params, **extra,
                  notes=f"the design documents' job with model.checkpoint -> a tiny Llama "
                        f"folder under $KC_HOME/data ({params:,} parameters: model.params), "
                        "permission.audit_log -> $KC_HOME/audit/audit.log (the default audit "
                        "root refuses /var/log/kuangchao), training.steps=3 by --set; "
                        "checkpoint.path left at its default (checkpoints, i.e. "
                        "$KC_HOME/checkpoints); no data section: the built-in corpus through "
                        "the model's tokenizer. 16 gloo ranks (dp4 x tp2 x pp2) on "
                        "examples/cluster-4x8.yaml; ours = kc submit -> SUCCEEDED")
    return job["state"] == "SUCCEEDED"


def _count_lines(path: Path) -> int | None:
    try:
        return sum(1 for _ in open(path))
    except OSError:
        return None


# -- main ----------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per system (step time)")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per run")
    parser.add_argument("--tokenize-mb", type=float, default=4.0,
                        help="MB of text to tokenize (the stdlib's modules, repeated)")
    parser.add_argument("--tokenize-repeats", type=int, default=3)
    parser.add_argument("--phases", default="tokenize,step",
                        help="comma-separated: tokenize, step, design")
    parser.add_argument("--design-job", action="store_true",
                        help="also run the design documents' 16-rank job (several GB of memory)")
    parser.add_argument("--design-steps", type=int, default=3)
    parser.add_argument("--design-timeout", type=float, default=1800.0)
    parser.add_argument("--quick", action="store_true",
                        help="tokenize and step phases, one short run each (0.3 MB of text; "
                             "a one-node stack, 12 steps): checks the script works")
    args = parser.parse_args()
    if args.quick:
        # Two steps past Ray Train's warm-up: the fewest that give its median step.
        args.repeats, args.steps = 1, WARMUP_STEPS + 2
        args.tokenize_mb, args.tokenize_repeats = 0.3, 1
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if args.design_job and "design" not in phases:
        phases.append("design")
    harness.keep_stdout_for_results()  # Ray and libraries print; stdout is the results'
    t0 = time.monotonic()
    failed = False
    for phase in phases:
        t = time.monotonic()
        log(f"phase {phase}")
        try:
            if phase == "tokenize":
                from bench import hf_tokenize

                work = Path(tempfile.mkdtemp(prefix="kcbench-hf-tok-"))
                try:
                    m = hf_tokenize.measure(work, args.tokenize_mb, args.tokenize_repeats,
                                            whole=not args.quick)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                for r in hf_tokenize.results(m):
                    emit_line(r.pop("metric"), r.pop("unit"), r.pop("ours"), r.pop("baseline"),
                              r.pop("target"), **r)
            elif phase == "step":
                step_time(args)
            elif phase == "design":
                failed = not design_job(args) or failed
            else:
                raise ValueError(f"unknown phase {phase!r} (tokenize, step, design)")
        except Exception as exc:
            failed = True
            log(f"phase {phase} failed:\n{traceback.format_exc()}")
            metric, unit, target = {"tokenize": ("tokenize_throughput", "tokens/s", 0.8),
                                    "step": ("hf_step_time_ratio", "s", 1.03),
                                    "design": ("design_job_16_ranks", "s", "SUCCEEDED")}.get(
                                        phase, (phase, "", None))
            emit_error(metric, unit, target, exc)
        log(f"phase {phase}: {time.monotonic() - t:.0f}s")
    log(f"total wall time {time.monotonic() - t0:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
