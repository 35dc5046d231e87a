"""Topology on live network hosts: the same gloo job placed by kuangchao, by Ray PACK and by Ray SPREAD.

    .venv/bin/python bench/topology_live.py [--quick] [--patterns 5] [--rounds 3] [--jobs dp4,tp2dp2]
                                            [--list-patterns]

Needs root (Linux network namespaces). The script brings up its own stack with
`kc up` on a netns cluster (bench/README.md, "topology_live.py"): 8 nodes of 2
GPUs in 2 leaves, every node a network host of its own, node links shaped to
2 Gbit/s, each leaf's uplink to the spine to 0.5 Gbit/s; `kc down` on the way
out, whatever happened (errors, Ctrl-C, SIGTERM), and a check that none of its
namespaces, links or bridges is left. Without root it prints its lines with an
error saying why. Two jobs, each on
several occupancy patterns (GPUs already held by other work, drawn from a fixed
seed; `--list-patterns` prints them):

- dp4: 4 data-parallel ranks of an MLP of 6.3M fp32 parameters (25 MB of
  gradients all-reduced each step over gloo);
- tp2dp2: the same MLP split column/row-parallel over tensor-parallel pairs
  (ranks (0,1) and (2,3): an all-reduce of the activations in the pair in each
  block, forward and backward), its gradients all-reduced between the pairs.

Each pattern is held by real work that both kuangchao and Ray see: one idle kc
"holder" job per occupied node (custom entrypoint `hold`), steered to its node
by a temporary GPU-type override (`kc node set NODE --gpu-type`, cleared as soon
as the holder is admitted). Its ranks hold the GPUs through Ray's GPU and
`kc_gpu_<i>` resources, so Ray's PACK and SPREAD cannot use them, and kc's
scheduler counts them as taken.

Three placements of the job, one after the other, on the same held pattern:

- kc: the job is submitted to the stack (kc defaults: its scheduler and
  placement solver); its placement (node, GPU ids per rank) is read back from
  the job record, the job is cancelled, and the training runs on exactly those
  GPUs, in kc's rank order, with the harness below;
- Ray PACK and Ray SPREAD: a placement group of the same bundles
  ({CPU: 1, GPU: 1} per rank), strategy PACK or SPREAD, Ray 2.60.0 defaults;
  world ranks as Ray Train v2 gives them (grouped by node, nodes in the order
  of their first bundle, by GPU id within a node).

All three run the same actor class, the same code, data and seed (`Rank.train`):
only the placement differs. Step time: the median over the timed steps of the
time between two consecutive steps' ends (a step ends when its last rank is
done), after the warm-up steps.

Lines (bench/README.md): `topology_step_time_ratio_dp4`,
`topology_step_time_ratio_tp2dp2` and `topology_step_time_ratio` (all
patterns of both jobs): kc's step time against the better of Ray's two, the
geometric mean over the patterns; target 0.7, and no pattern above 1.05
(`max_pattern_ratio`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` when run as a script

from bench.report import emit, keep_stdout_for_results, log, median, wait_for_quiet  # noqa: E402

BENCH = "topology_live"
REPO_ROOT = Path(__file__).resolve().parent.parent

# -- the cluster ----------------------------------------------------------------
NODES, GPUS_PER_NODE, CPUS_PER_NODE, LEAVES = 8, 2, 4, 2
LEAF_GBPS, SPINE_GBPS = 2.0, 0.5
NODE_NAMES = tuple(f"node-{i}" for i in range(NODES))
# The quick mode's cluster: 2 leaves of 2 nodes. Each node costs a `ray start`, a
# raylet, two Ray agents and a netns host (about 4 CPU-s a run here, most of it
# start-up), and on 4 nodes tp2dp2 still finds two whole nodes in one leaf beside
# the GPUs its pattern holds (`use_nodes`).
QUICK_NODES = 4


def leaf_of(node: str) -> str:
    return f"leaf-{int(node.rsplit('-', 1)[1]) * LEAVES // NODES}"


def cluster_yaml() -> str:
    lines = ["name: topology-live", "isolation: netns", f"leaf_gbps: {LEAF_GBPS:g}",
             f"spine_gbps: {SPINE_GBPS:g}", "leaf_labels: true", "nodes:"]
    lines += [f"  - {{name: {n}, gpus: {GPUS_PER_NODE}, nvlink: full, leaf: {leaf_of(n)}, "
              f"cpus: {CPUS_PER_NODE}}}" for n in NODE_NAMES]
    return "\n".join(lines) + "\n"


# -- the jobs and the occupancy patterns ------------------------------------------
JOBS = {"dp4": (4, 1), "tp2dp2": (2, 2)}  # name: (data-parallel size, tensor-parallel size)
SEED = 27  # issue 27
PATTERNS = 5
# Each job's model: `blocks` residual MLP blocks (LayerNorm, d -> ffn, GELU,
# ffn -> d) on `tokens` random tokens a step; both 6.3M fp32 parameters (25 MB of
# gradients). tp2dp2's blocks are wide and its token count larger so that, as in
# real tensor-parallel training, the pair's activation all-reduces carry at least
# what the gradient all-reduce does (16.8 MB against 12.8 MB per rank and step);
# with dp4's shape they would carry 0.5 MB, and no one splits such a model.
SHAPES = {"dp4": {"d": 512, "ffn": 3072, "blocks": 2, "tokens": 64},
          "tp2dp2": {"d": 8192, "ffn": 192, "blocks": 2, "tokens": 128}}
WARMUP, TIMED = 3, 8
ROUNDS = 3
QUIET_S = 15  # the longest wait for quiet CPUs before each run
QUICK_WARMUP, QUICK_TIMED = 1, 2  # two gaps between step ends: a median of the timed steps
QUICK_JOBS = "tp2dp2"
TARGET, TARGET_MAX_PATTERN = 0.7, 1.05
# GPU types that steer each holder job to its node (any catalogue types will do;
# the overrides last only until the holders are admitted).
STEER_TYPES = ("h100-80gb", "a100-80gb", "a100-40gb", "h200-141gb")
SYSTEMS = ("kc", "ray_pack", "ray_spread")


def draw_patterns(job: str, count: int, seed: int = SEED) -> list[dict[str, int]]:
    """`count` distinct occupancy patterns for `job`: {node: GPUs held there}.

    Each draws how many GPUs are held (1 up to all but the job's own), then which
    ones, uniformly over the cluster's GPUs. A pattern the job cannot run on under
    kc's rules (a tensor-parallel group never spans nodes, so tp2dp2 needs two
    whole free nodes) is drawn again: kc would wait for room there, not run."""
    dp, tp = JOBS[job]
    need = dp * tp
    slots = [(n, g) for n in NODE_NAMES for g in range(GPUS_PER_NODE)]
    rng = random.Random(f"{seed}:{job}")
    out: list[dict[str, int]] = []
    while len(out) < count:
        held = rng.sample(slots, rng.randint(1, len(slots) - need))
        pattern = {n: c for n in NODE_NAMES if (c := sum(1 for m, _ in held if m == n))}
        groups = sum((GPUS_PER_NODE - pattern.get(n, 0)) // tp for n in NODE_NAMES)
        if groups >= dp and pattern not in out:
            out.append(pattern)
    return out


def one_leaf_possible(job: str, pattern: dict[str, int]) -> bool:
    """Whether `job` fits inside one leaf on `pattern` (tensor-parallel groups within a
    node). Where it does not, every placement crosses the spine, and kc can win only
    by its rank order: a ratio near 1 is the expected result there."""
    dp, tp = JOBS[job]
    return any(sum((GPUS_PER_NODE - pattern.get(n, 0)) // tp for n in NODE_NAMES
                   if leaf_of(n) == leaf) >= dp for leaf in {leaf_of(n) for n in NODE_NAMES})


def pattern_text(pattern: dict[str, int]) -> str:
    return ", ".join(f"{n}: {c}" for n, c in pattern.items())


# -- the training every placement runs ----------------------------------------------

def _tp_ops():
    """The two tensor-parallel autograd functions (Megatron's f and g)."""
    import torch
    import torch.distributed as dist

    class CopyToTP(torch.autograd.Function):
        """Identity forward; all-reduce of the input's gradient in the pair backward."""

        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=ctx.group)
            return grad, None

    class ReduceFromTP(torch.autograd.Function):
        """All-reduce of the partial outputs in the pair forward; identity backward."""

        @staticmethod
        def forward(ctx, x, group):
            x = x.contiguous().clone()
            dist.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    return CopyToTP, ReduceFromTP


def build_params(shape: dict[str, int], tp: int, tp_rank: int, seed: int) -> list:
    """This rank's shard of every block's parameters: the full model is drawn from
    `seed` on every rank, then W1 is cut by columns (outputs) and W2 by rows."""
    import torch

    d, ffn = shape["d"], shape["ffn"]
    g = torch.Generator().manual_seed(seed)
    shard = ffn // tp
    cut = slice(tp_rank * shard, (tp_rank + 1) * shard)
    params = []
    for _ in range(shape["blocks"]):
        w1 = torch.randn(ffn, d, generator=g) * d ** -0.5
        w2 = torch.randn(d, ffn, generator=g) * ffn ** -0.5
        block = {"ln_w": torch.ones(d), "ln_b": torch.zeros(d), "w1": w1[cut].clone(),
                 "b1": torch.zeros(ffn)[cut].clone(), "w2": w2[:, cut].clone(),
                 "b2": torch.zeros(d)}
        params.append({k: torch.nn.Parameter(v) for k, v in block.items()})
    return params


def forward(params: list, x, tp_group, ops):
    import torch.nn.functional as F

    copy_to, reduce_from = ops
    for p in params:
        h = F.layer_norm(x, x.shape[-1:], p["ln_w"], p["ln_b"])
        if tp_group is not None:
            h = copy_to.apply(h, tp_group)
        h = F.linear(F.gelu(F.linear(h, p["w1"], p["b1"])), p["w2"])
        if tp_group is not None:
            h = reduce_from.apply(h, tp_group)
        x = x + h + p["b2"]
    return x


def train(init: str, rank: int, world: int, tp: int, shape: dict[str, int], steps: int,
          seed: int) -> dict[str, Any]:
    """One rank of the job: gloo at `init`, `steps` steps; returns the time after each."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dp = world // tp
    dp_index, tp_rank = divmod(rank, tp)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        tp_group = dp_group = None
        for d in range(dp):  # every rank makes every group, in one order
            g = dist.new_group([d * tp + t for t in range(tp)]) if tp > 1 else None
            if d == dp_index:
                tp_group = g
        for t in range(tp):
            g = dist.new_group([d * tp + t for d in range(dp)]) if tp > 1 and dp > 1 else None
            if t == tp_rank:
                dp_group = g
        params = build_params(shape, tp, tp_rank, seed)
        flat_params = [p for block in params for p in block.values()]
        opt = torch.optim.SGD(flat_params, lr=1e-3, momentum=0.9)
        ops = _tp_ops()
        dist.barrier()
        stamps, losses = [], []
        for step in range(steps):
            g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + dp_index)
            x = torch.randn(shape["tokens"], shape["d"], generator=g)
            y = torch.randn(shape["tokens"], shape["d"], generator=g)
            loss = ((forward(params, x, tp_group, ops) - y) ** 2).mean()
            loss.backward()
            if dp > 1:  # one flat buffer, as DDP's buckets add up to
                grads = torch.cat([p.grad.reshape(-1) for p in flat_params])
                dist.all_reduce(grads, group=dp_group)
                grads /= dp
                off = 0
                for p in flat_params:
                    p.grad.copy_(grads[off:off + p.numel()].view_as(p))
                    off += p.numel()
            opt.step()
            opt.zero_grad(set_to_none=False)
            stamps.append(time.time())
            losses.append(float(loss.detach()))
        return {"stamps": stamps, "loss": losses[-1]}
    finally:
        dist.destroy_process_group()


class Rank:
    """The actor every placement runs its ranks in (decorated with ray.remote by the driver)."""

    def where(self) -> dict[str, Any]:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address(), "gpu_ids": [int(g) for g in ray.get_gpu_ids()]}

    def free_port(self, ip: str) -> int:
        with socket.socket() as s:
            s.bind((ip, 0))
            return s.getsockname()[1]

    def train(self, init: str, rank: int, world: int, tp: int, shape: dict[str, int], steps: int,
              seed: int) -> dict[str, Any]:
        return train(init, rank, world, tp, shape, steps, seed)


def step_times(results: list[dict[str, Any]], warmup: int) -> list[float]:
    """Per timed step: the gap between two consecutive steps' ends (a step ends
    when its last rank is done)."""
    ends = [max(r["stamps"][i] for r in results) for i in range(len(results[0]["stamps"]))]
    return [ends[i] - ends[i - 1] for i in range(warmup, len(ends))]


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


# -- holding GPUs: idle kc jobs -------------------------------------------------

def hold(ctx) -> dict[str, Any]:
    """The holder's entrypoint: hold the GPUs until the job is cancelled."""
    while not ctx.should_stop():
        time.sleep(0.5)
    return {"held": True}


def kc_doc(name: str, home: Path, dp: int, tp: int, gpus_per_rank: int = 1,
           gpu_types: list[str] | None = None) -> dict[str, Any]:
    """A kc job running `hold`. Its model section gives the scheduler the benchmark
    model's size (a GPT of 2 layers at d_model 512 has 12 x 2 x 512^2 = 6.3M
    parameters, as both MLPs have), so the solver prices its gradient traffic."""
    return {
        "task": {"name": name},
        "model": {"type": "gpt", "n_layers": 2, "n_heads": 8, "d_model": 512,
                  "seq_len": 64, "vocab_size": 256},
        "data": {"max_bytes": 100_000},
        "parallel": {"data_parallel_size": dp, "tensor_parallel_size": tp,
                     "micro_batch_size": 1, "gpus_per_rank": gpus_per_rank, "cpus_per_rank": 1},
        "resources": {"gpu_types": gpu_types or []},
        "training": {"steps": 1, "seed": SEED},
        "checkpoint": {"interval_steps": 1, "path": str(home / "ckpt")},
        "fault_tolerance": {"max_restarts": 0, "hang_timeout_s": 86400, "stop_grace_s": 2},
        "entrypoint": "bench.topology_live:hold",
    }


TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


class Stack:
    """The running stack: its API client, the Ray driver connection and the node map."""

    def __init__(self, state: dict[str, Any], home: Path) -> None:
        import configparser

        from kuangchao.api.sdk.client import Client

        parser = configparser.ConfigParser()
        parser.read(home / "credentials")
        self.state, self.home = state, home
        self.client = Client(state["api_url"], parser["default"]["api_key"], timeout=60)
        self.names: dict[str, str] = {}  # Ray node id -> kc node name

    def wait(self, pred, timeout_s: float, what: str) -> Any:
        """Poll the stack (`pred`) every half second until it says something truthy;
        raises when `timeout_s` passes. (Not bench.recovery_common.wait_until: that
        module brings torch, which neither this driver nor the holders need.)"""
        deadline = time.monotonic() + timeout_s
        while not (got := pred()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
            time.sleep(0.5)
        return got

    def connect(self) -> None:
        import logging

        import ray

        from kuangchao.platform.runtime import ray_connect

        ray_connect.connect(self.state["ray_address"], namespace="kcbench-topology",
                            logging_level=logging.ERROR,
                            runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}})
        self.names = {n["NodeID"]: (n.get("Labels") or {}).get("kc.io/node", "?")
                      for n in ray.nodes() if n.get("Alive")}

    def free_gpus(self) -> float:
        import ray

        return ray.available_resources().get("GPU", 0.0)

    def wait_free(self, gpus: int, timeout: float = 120) -> None:
        self.wait(lambda: abs(self.free_gpus() - gpus) < 1e-6, timeout, f"{gpus} GPUs free in Ray")

    def hold(self, pattern: dict[str, int]) -> list[dict[str, Any]]:
        """Submit one holder job per occupied node, steered there; returns the running jobs."""
        jobs = []
        nodes = list(pattern)
        try:
            # As many nodes at a time as there are steering types (each a type of its own).
            for at in range(0, len(nodes), len(STEER_TYPES)):
                steer = dict(zip(nodes[at:at + len(STEER_TYPES)], STEER_TYPES, strict=False))
                try:
                    for node, kind in steer.items():
                        self.client.set_node(node, gpu_type=kind)
                    self.wait(lambda s=steer: all(n.get("gpu_type") == s.get(n["name"], n.get("gpu_type"))
                                                  for n in self.client.nodes()["nodes"]), 60,
                              "the overrides")
                    batch = [self.client.submit(kc_doc(f"hold-{node}", self.home, 1, 1,
                                                       pattern[node], [kind]))
                             for node, kind in steer.items()]
                    jobs += batch
                    for job in batch:
                        self.wait(lambda j=job: self.client.get(j.id)["state"] != "QUEUED", 120,
                                  f"holder {job.id} admitted")
                finally:
                    for node in steer:
                        self.client.set_node(node, gpu_type=None)
            placed = []
            for job in jobs:
                got = self.wait(lambda j=job: (r := self.client.get(j.id))["state"] in
                                ("RUNNING", *TERMINAL) and r, 180, f"holder {job.id} running")
                if got["state"] != "RUNNING":
                    raise RuntimeError(f"holder {job.id} ended {got['state']}: "
                                       f"{got.get('message')}")
                placed.append(got)
            wrong = [(p["node"], j["name"]) for j in placed for p in j["placement"]
                     if j["name"] != f"hold-{p['node']}"]
            if wrong:
                raise RuntimeError(f"holders landed elsewhere: {wrong}")
            self.wait_free(NODES * GPUS_PER_NODE - sum(pattern.values()))
            return placed
        except BaseException:
            self.release([dict(j) for j in jobs])  # a pattern half held is no pattern
            raise

    def release(self, jobs: list[dict[str, Any]]) -> None:
        for job in jobs:
            try:
                self.client.cancel(job["id"])
            except Exception as exc:  # noqa: BLE001 -- it may have ended already
                log(f"cancel {job['id']}: {exc}")
        for job in jobs:
            self.wait(lambda j=job: self.client.get(j["id"])["state"] in TERMINAL, 120,
                      f"{job['id']} to end")

    def kc_placement(self, job: str, held: int) -> list[dict[str, Any]]:
        """Where kc places the job now: submitted at kc's defaults, read back, cancelled."""
        dp, tp = JOBS[job]
        sub = self.client.submit(kc_doc(f"measure-{job}", self.home, dp, tp))
        try:
            got = self.wait(lambda: (r := self.client.get(sub.id))["state"] != "QUEUED" and r,
                            120, f"kc to admit {sub.id}")
            placement = sorted(got["placement"], key=lambda p: p["rank"])
            self.wait(lambda: self.client.get(sub.id)["state"] in ("RUNNING", *TERMINAL), 180,
                      f"{sub.id} running")
        finally:
            self.release([dict(sub)])
        self.wait_free(NODES * GPUS_PER_NODE - held)
        return [{"rank": p["rank"], "node": p["node"], "node_id": p["node_id"],
                 "gpus": list(p["gpus"])} for p in placement]


def ray_train_order(where: list[dict[str, Any]]) -> list[int]:
    """The bundle indices in world-rank order as Ray Train v2 ranks its workers
    (`_sort_workers_by_gpu_id_grouped_by_node`, worker_group.py): grouped by node,
    nodes in the order of their first bundle, by GPU id within a node. Better for
    Ray than rank i = bundle i, which can interleave two nodes' ranks in the ring."""
    first: dict[str, int] = {}
    for i, w in enumerate(where):
        first.setdefault(w["node_id"], i)
    return sorted(range(len(where)), key=lambda i: (first[where[i]["node_id"]],
                                                    min(where[i]["gpu_ids"], default=0), i))


def run_placement(stack: Stack, system: str, job: str, kc_slots: list[dict[str, Any]] | None,
                  steps: int, warmup: int) -> dict[str, Any]:
    """Train `job` on the placement `system` makes; returns its step times and where it ran."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from bench import topology_live as me  # by reference, so Ray workers import it

    dp, tp = JOBS[job]
    world = dp * tp
    if system == "kc":
        assert kc_slots is not None
        bundles = [{"CPU": 1, "GPU": 1, **{f"kc_gpu_{g}": 1 for g in s["gpus"]}} for s in kc_slots]
        pg = placement_group(bundles, strategy="PACK",
                             bundle_label_selector=[{"ray.io/node-id": s["node_id"]}
                                                    for s in kc_slots])
    else:
        pg = placement_group([{"CPU": 1, "GPU": 1}] * world,
                             strategy="PACK" if system == "ray_pack" else "SPREAD")
    actors = []
    try:
        ray.get(pg.ready(), timeout=120)
        cls = ray.remote(me.Rank)
        actors = [cls.options(num_cpus=1, num_gpus=1, scheduling_strategy=(
            PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i))).remote()
            for i in range(world)]
        where = ray.get([a.where.remote() for a in actors], timeout=300)
        if system != "kc":  # Ray Train v2's world ranks, not bundle order
            order = ray_train_order(where)
            actors, where = [actors[i] for i in order], [where[i] for i in order]
        port = ray.get(actors[0].free_port.remote(where[0]["ip"]), timeout=60)
        init = f"tcp://{where[0]['ip']}:{port}"
        results = ray.get([a.train.remote(init, r, world, tp, SHAPES[job], steps, SEED)
                           for r, a in enumerate(actors)], timeout=900)
    finally:
        for a in actors:
            ray.kill(a)
        remove_placement_group(pg)
    times = step_times(results, warmup)
    if system == "kc":
        placed = [f"{s['node']}:{','.join(map(str, s['gpus']))}" for s in kc_slots]
    else:
        placed = [f"{stack.names.get(w['node_id'], w['node_id'][:8])}:"
                  f"{','.join(map(str, w['gpu_ids']))}" for w in where]
    return {"step_s": median(times), "times": times, "placement": placed,
            "leaves": sorted({leaf_of(p.split(':')[0]) for p in placed}),
            "loss": results[0]["loss"]}


# -- the stack ----------------------------------------------------------------------

def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextmanager
def netns_stack() -> Iterator[Stack]:
    """`kc up` on the netns cluster with a KC_HOME of its own; `kc down` always, and a
    check that none of its namespaces is left."""
    tmp = Path(tempfile.mkdtemp(prefix="kcbench-topo-"))
    home = tmp / "home"
    (tmp / "cluster.yaml").write_text(cluster_yaml())
    env = {**os.environ, "KC_HOME": str(home), "KC_REDIS_PREFIX": f"kcbench-{secrets.token_hex(4)}:",
           "KC_QUARANTINE_FAILURES": "0",
           # holders import bench.topology_live on the nodes
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH"))
                                         if p)}
    for name in ("KC_REDIS_URL", "KC_API_URL", "KC_API_KEY"):
        env.pop(name, None)
    kc = str(Path(sys.executable).parent / "kc")
    token_file = Path.home() / ".ray" / "auth_token"
    had_token = token_file.exists()
    old_home = os.environ.get("KC_HOME")
    os.environ["KC_HOME"] = str(home)  # ray_connect finds the stack's Ray token through it
    net: dict[str, Any] | None = None  # the stack's network plan, once known
    t0 = time.monotonic()
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        # A session of its own: Ctrl-C, or `timeout` signalling its process group, reaches
        # this script alone, which takes the stack down in order (not the stack's
        # processes at random, half of them surviving).
        out = subprocess.run([kc, "up", "--cluster", str(tmp / "cluster.yaml"), "--api-port", "0",
                              "--dashboard-port", "0", "--json"], capture_output=True, text=True,
                             env=env, timeout=600, start_new_session=True)
        if out.returncode != 0:
            raise RuntimeError(f"kc up failed: {out.stderr[-2000:]}")
        state = json.loads(out.stdout)
        net = state.get("net")
        log(f"stack up in {time.monotonic() - t0:.0f}s: ray {state['ray_address']}, api "
            f"{state['api_url']}, netns tag {(net or {}).get('tag')}")
        stack = Stack(state, home)
        stack.connect()
        # Ray's driver takes SIGTERM over (its core worker aborts on it, leaving the
        # stack up): a `kill` must unwind like Ctrl-C, through `kc down` below.
        signal.signal(signal.SIGTERM, _interrupted)
        yield stack
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second kill must not cut `kc down` short
        try:
            import ray

            ray.shutdown()
        except Exception as exc:  # noqa: BLE001
            log(f"ray.shutdown: {exc}")
        if net is None:  # kc up failed or was interrupted: its record, if it got that far
            try:
                net = json.loads((home / "cluster.json").read_text()).get("net")
            except (OSError, ValueError):
                pass
        down = subprocess.run([kc, "down"], capture_output=True, text=True, env=env, timeout=300)
        if down.returncode != 0:
            log(f"kc down exited {down.returncode}: {down.stderr[-1000:]}")
        _check_network_gone(net)
        if not had_token and token_file.exists():
            token_file.unlink()
        if old_home is None:
            os.environ.pop("KC_HOME", None)
        else:
            os.environ["KC_HOME"] = old_home
        shutil.rmtree(tmp, ignore_errors=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _check_network_gone(net: dict[str, Any] | None) -> None:
    """After `kc down`: none of the stack's namespaces, links or bridges may be left
    (`ip netns list`); whatever is, is removed here and said."""
    from kuangchao.platform.cluster.netplan import NetPlan
    from kuangchao.platform.runtime import netns

    if not net:
        log("kc down: the stack made no network")
        return
    left = netns.leftovers(net["tag"])
    if left:
        log(f"kc down left {left} behind; removing them")
        netns.remove(NetPlan.from_json(net))
        left = netns.leftovers(net["tag"])
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    mine = [ln.split()[0] for ln in listed.splitlines() if ln.startswith(f"kc-{net['tag']}-")]
    if left or mine:
        log(f"still left after removal: {sorted(set(left) | set(mine))}")
    else:
        log(f"kc down: no namespace, link or bridge of this stack is left (tag {net['tag']})")


# -- the measurement ------------------------------------------------------------------

def measure_pattern(stack: Stack, job: str, pattern: dict[str, int], index: int,
                    steps: int, warmup: int, rounds: int, quiet_s: float) -> dict[str, Any]:
    """The three placements of `job` on one held pattern. Each runs `rounds` times,
    the order rotating from one pattern to the next and reversed in every other
    round (ABC CBA ...), so drift in the machine's load falls on all three; a
    system's step time is the median of its timed steps over all its rounds."""
    held = sum(pattern.values())
    free_after = NODES * GPUS_PER_NODE - held
    out: dict[str, Any] = {"job": job, "pattern": index, "held": pattern, "errors": {}}
    holders = stack.hold(pattern)
    try:
        out["held_gpus"] = [f"{p['node']}:{','.join(map(str, p['gpus']))}"
                            for j in holders for p in j["placement"]]
        kc_slots = None
        try:
            kc_slots = stack.kc_placement(job, held)
        except Exception as exc:  # noqa: BLE001 -- counted, never dropped
            out["errors"]["kc"] = f"kc placement: {exc}"
        first = SYSTEMS[index % 3:] + SYSTEMS[:index % 3]  # each pattern starts elsewhere
        order = [s for r in range(rounds) for s in (first if r % 2 == 0 else first[::-1])]
        got: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
        for system in order:
            if system == "kc" and kc_slots is None:
                continue
            busy = wait_for_quiet(timeout_s=quiet_s) if quiet_s > 0 else None
            t0 = time.monotonic()
            try:
                r = run_placement(stack, system, job, kc_slots, steps, warmup)
            except Exception as exc:  # noqa: BLE001
                out["errors"][system] = f"{type(exc).__name__}: {exc}"[:500]
                log(f"{job} pattern {index} {system} failed: {out['errors'][system]}")
                stack.wait_free(free_after)
                continue
            got[system].append(r)
            log(f"{job} pattern {index} [{pattern_text(pattern)}] {system:10s} "
                f"{r['step_s']:.3f}s/step  {' '.join(r['placement'])}  (leaves "
                f"{','.join(r['leaves'])}; steps {' '.join(f'{t:.3f}' for t in r['times'])}; "
                f"{time.monotonic() - t0:.0f}s; CPUs "
                f"{'?' if busy is None else f'{busy:.0%}'} busy before, load "
                f"{os.getloadavg()[0]:.1f})")
            stack.wait_free(free_after)
        for system, rs in got.items():
            if rs and system not in out["errors"]:
                times = [t for r in rs for t in r["times"]]
                out[system] = {"step_s": median(times), "placement": rs[0]["placement"],
                               "rounds": [r["step_s"] for r in rs],
                               "placements": [r["placement"] for r in rs],
                               "loss": rs[0]["loss"]}
    finally:
        stack.release(holders)
        stack.wait_free(NODES * GPUS_PER_NODE)
    ray_best = [out[s]["step_s"] for s in ("ray_pack", "ray_spread") if s in out]
    if "kc" in out and ray_best:
        out["ratio"] = out["kc"]["step_s"] / min(ray_best)
        out["ray_best"] = min(ray_best)
        log(f"{job} pattern {index}: kc {out['kc']['step_s']:.3f}s, best Ray {min(ray_best):.3f}s,"
            f" ratio {out['ratio']:.3f}")
    return out


def summary(p: dict[str, Any]) -> dict[str, Any]:
    """A pattern as it goes into the line."""
    s: dict[str, Any] = {"job": p["job"], "pattern": p["pattern"], "held": p["held"],
                         "held_gpus": p.get("held_gpus"),
                         "one_leaf_possible": one_leaf_possible(p["job"], p["held"])}
    for system in SYSTEMS:
        if system in p:
            s[system] = {"step_s": round(p[system]["step_s"], 5),
                         "rounds": [round(x, 5) for x in p[system]["rounds"]],
                         "placement": p[system]["placement"],
                         "loss": p[system]["loss"]}  # rank 0's last: the same training on all three
            if any(pl != p[system]["placement"] for pl in p[system]["placements"]):
                s[system]["placements"] = p[system]["placements"]  # Ray chose anew each round
    if "ratio" in p:
        s["ratio"] = round(p["ratio"], 4)
    if p["errors"]:
        s["errors"] = p["errors"]
    return s


def settings_text() -> str:
    return (f"Ray 2.60.0 placement groups of {{CPU: 1, GPU: 1}} per rank, strategy PACK and "
            f"strategy SPREAD (ranks ordered as Ray Train v2 orders its workers), the better of "
            f"the two per pattern; kc at its "
            f"defaults (a real submission; its placement replayed in the same harness); "
            f"{NODES} netns nodes x {GPUS_PER_NODE} GPUs, {LEAVES} leaves, leaf links "
            f"{LEAF_GBPS:g} Gbit/s, spine uplinks {SPINE_GBPS:g} Gbit/s; gloo, fp32 MLPs of 6.3M "
            f"parameters: " + "; ".join(f"{job} {s['blocks']}x({s['d']}->{s['ffn']}->{s['d']}) on "
                                        f"{s['tokens']} tokens/step" for job, s in SHAPES.items()))


SETTINGS = settings_text()


def use_nodes(count: int) -> None:
    """Build the cluster of `count` nodes, still in LEAVES leaves, instead of NODES
    (the quick mode's QUICK_NODES). Only this driver reads these names: the ranks
    and the holders never do."""
    global NODES, NODE_NAMES, SETTINGS
    NODES, NODE_NAMES = count, tuple(f"node-{i}" for i in range(count))
    SETTINGS = settings_text()


def emit_line(metric: str, runs: list[dict[str, Any]],
              error: str | None = None) -> None:
    done = [p for p in runs if "ratio" in p]
    ours = geomean([p["kc"]["step_s"] for p in done]) if done else None
    base = geomean([p["ray_best"] for p in done]) if done else None
    bad = [p for p in runs if "ratio" not in p]
    extra: dict[str, Any] = {}
    if error or bad:
        extra["error"] = error or "; ".join(
            f"{p['job']} pattern {p['pattern']}: {p['errors'] or 'incomplete'}" for p in bad)[:1000]
    ratios = [p["ratio"] for p in done]
    if done:
        worst = max(done, key=lambda p: p["ratio"])
        extra["worst_pattern"] = f"{worst['job']} {worst['pattern']} [{pattern_text(worst['held'])}]"
        # Informative: the same geometric mean over the patterns where the job fits in
        # one leaf (elsewhere every placement crosses the spine).
        fits = [p["ratio"] for p in done if one_leaf_possible(p["job"], p["held"])]
        extra["one_leaf_patterns"] = {"count": len(fits),
                                      "ratio": round(geomean(fits), 4) if fits else None}
    emit(BENCH, metric, "s", ours, base, TARGET, better="lower", target_on="ratio",
         patterns=[summary(p) for p in runs],
         max_pattern_ratio=round(max(ratios), 4) if ratios else None,
         target_max_pattern=TARGET_MAX_PATTERN,
         max_pattern_met=bool(ratios) and max(ratios) <= TARGET_MAX_PATTERN,
         failed_runs={"ours": sum(1 for p in runs if "kc" not in p),
                      "baseline": sum(1 for p in runs
                                      if "ray_pack" not in p and "ray_spread" not in p)},
         settings=SETTINGS, **extra)


METRICS = ("topology_step_time_ratio_dp4", "topology_step_time_ratio_tp2dp2",
           "topology_step_time_ratio")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"pattern 0 of tp2dp2 alone (unless --jobs) on {QUICK_NODES} nodes, "
                         f"{QUICK_WARMUP} + {QUICK_TIMED} steps")
    ap.add_argument("--patterns", type=int, default=PATTERNS, help="patterns per job")
    ap.add_argument("--rounds", type=int, default=None,
                    help=f"runs of each placement per pattern (default {ROUNDS}; quick 1)")
    ap.add_argument("--jobs", default=None,
                    help="comma-separated: dp4,tp2dp2 (default both; quick tp2dp2)")
    ap.add_argument("--list-patterns", action="store_true", help="print the patterns and exit")
    args = ap.parse_args(argv)
    if args.quick:
        use_nodes(QUICK_NODES)
    count = 1 if args.quick else args.patterns
    # The quick mode (make test) runs tp2dp2 alone: it goes through every code path dp4
    # does (its data-parallel all-reduce in a group) and the tensor-parallel ones too.
    default_jobs = QUICK_JOBS if args.quick else ",".join(JOBS)
    jobs = [j.strip() for j in (args.jobs or default_jobs).split(",") if j.strip()]
    if unknown := [j for j in jobs if j not in JOBS]:
        ap.error(f"--jobs: unknown job(s) {', '.join(unknown)}; choose from {', '.join(JOBS)}")
    patterns = {job: draw_patterns(job, count) for job in jobs}
    if args.list_patterns:
        for job, ps in patterns.items():
            for i, p in enumerate(ps):
                print(f"{job} {i}: {pattern_text(p)}"
                      f"{'' if one_leaf_possible(job, p) else '  (no one-leaf placement)'}")
        return 0
    keep_stdout_for_results()
    warmup, timed = (QUICK_WARMUP, QUICK_TIMED) if args.quick else (WARMUP, TIMED)
    rounds = args.rounds or (1 if args.quick else ROUNDS)
    from kuangchao.platform.runtime import netns

    why = netns.unavailable()
    if why:
        log(f"skipped: {why}")
        for metric in METRICS:
            emit(BENCH, metric, "s", None, None, TARGET, better="lower", target_on="ratio",
                 error=f"skipped: needs a netns cluster: {why}", settings=SETTINGS)
        return 0
    import ray

    log(f"settings: {SETTINGS}")
    log(f"Ray {ray.__version__}: baselines are placement_group(bundles, strategy='PACK') and "
        f"strategy='SPREAD', bundle {{CPU: 1, GPU: 1}} x world size, defaults otherwise, world "
        f"ranks as Ray Train v2 orders its workers (grouped by node, nodes in the order of "
        f"their first bundle, by GPU id within a node); "
        f"kuangchao at its defaults (gang policy, its placement solver): the job is submitted "
        f"to the stack, its placement read back from the job record and replayed with the "
        f"same harness, so all three run exactly the same code")
    log(f"{warmup} warm-up + {timed} timed steps per run, {rounds} run(s) of each placement "
        f"per pattern; seed {SEED}; "
        f"patterns: " + "; ".join(f"{job} {i}: [{pattern_text(p)}]"
                                  for job, ps in patterns.items() for i, p in enumerate(ps)))
    runs: dict[str, list[dict[str, Any]]] = {job: [] for job in jobs}
    error = None
    t0 = time.monotonic()
    try:
        with netns_stack() as stack:
            for job in jobs:
                for i, pattern in enumerate(patterns[job]):
                    try:
                        runs[job].append(measure_pattern(stack, job, pattern, i, warmup + timed,
                                                         warmup, rounds,
                                                         0 if args.quick else QUIET_S))
                    except Exception as exc:  # noqa: BLE001 -- the pattern is failed, not dropped
                        log(f"{job} pattern {i} failed: {type(exc).__name__}: {exc}")
                        runs[job].append({"job": job, "pattern": i, "held": pattern,
                                          "errors": {"pattern": f"{type(exc).__name__}: {exc}"[:500]}})
    except Exception as exc:  # noqa: BLE001 -- the stack itself: every line says so
        error = f"{type(exc).__name__}: {exc}"[:1000]
        log(f"failed: {error}")
    log(f"done in {time.monotonic() - t0:.0f}s; per pattern (s/step, median of the timed steps):")
    for p in (p for job in jobs for p in runs[job]):
        cols = [f"{p[s]['step_s']:.3f}" if s in p else "failed" for s in SYSTEMS]
        ratio = f"{p['ratio']:.3f}" if "ratio" in p else "-"
        log(f"  {p['job']:7s} {p['pattern']}  [{pattern_text(p['held'])}]  kc {cols[0]}  "
            f"PACK {cols[1]}  SPREAD {cols[2]}  ratio {ratio}")
    for job in jobs:
        emit_line(f"topology_step_time_ratio_{job}", runs[job], error=error)
    emit_line("topology_step_time_ratio", [p for job in jobs for p in runs[job]], error=error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
