"""The Ray half of bench/resize.py: how long Ray Train v2's elastic training
(`ScalingConfig(num_workers=(min, max))`) takes to resize a running job.

* shrink: the job runs at 3 workers, one per worker node; one node's raylet is
  SIGKILLed (what `ray.cluster_utils.Cluster.remove_node` does). Ray Train
  restarts the worker group from its latest checkpoint at 2 workers.
  `resize_s` = kill -> first step at world size 2 completed on every rank
  (the latest rank's trace line for it: kuangchao's side is stamped at the
  same event, see bench/resize_kc.py).
* grow: the job runs at 2 workers on the only 2 worker nodes; a 3rd node
  joins (`bench.resize_common.add_node`). Ray Train restarts the worker group
  from its latest checkpoint at 3 workers. `resize_s` = the node is alive in
  `ray.nodes()` -> first step at world size 3 completed on every rank.

Once that step and CKPT_EVERY more are done, the bench asks the run to end
(`request_stop`: every rank reads `{trace}/stop` after each step and ends
after the same one), so fit() returns without training to a guessed count.

`decision_s` is the time from Ray Train's own decision to that first step: the
controller's state changes are recorded by a `ControllerCallback`
(`ControllerTrace`, passed in `RunConfig(callbacks=...)`, which Ray Train v2
hands to its controller actor); the decision is the controller entering
`ResizingState` (grow: the elastic policy saw more resources while the group
was healthy) or the `SchedulingState` that starts the smaller group (shrink).

How Ray Train v2 (ray 2.60) decides to resize
---------------------------------------------
`ScalingConfig(num_workers=(lo, hi))` selects `ElasticScalingPolicy`
(ray/train/v2/_internal/execution/scaling_policy/elastic.py). The controller
loop (`TrainController._step`) polls the workers every
`RAY_TRAIN_HEALTH_CHECK_INTERVAL_S` (env var, default 2 s); while the group is
healthy it asks the policy `make_decision_for_running_worker_group`, which
only looks again once `ScalingConfig.elastic_resize_monitor_interval_s`
(default 60 s) has passed since the group started or since its last look.
It then counts the workers that fit into the resources the Ray Data
`AutoscalingCoordinator` actor has reserved for the run (query cached for
`ElasticScalingPolicy.GET_RESERVED_RESOURCES_INTERVAL_S` = 1 s, a class
constant), and resizes when that count differs from the group's size
(restart of the whole group: shut down, start `n` workers, restore from the
latest checkpoint). After a worker failure the same count decides the size
of the restarted group (`make_decision_for_non_running_worker_group`).

The coordinator (`_AutoscalingCoordinatorActor`, a detached actor in
ray/data/_internal/cluster_autoscaler/default_autoscaling_coordinator.py)
refreshes its view of the cluster (`ray.nodes()`) only on its background tick
every `TICK_INTERVAL_S` = 20 s, a class constant with no env var or config
(or when a requester changes its request, which Ray Train never does: it
always asks for `hi` workers). So at Ray's defaults a node that joins or dies
is seen by Ray Train 0..20 s later; that tick, not the monitor interval,
dominates (this bench ticks it every 0.5 s, below).
Reservations count each node's *total* resources and ignore label selectors,
so workers ask for `{"CPU": 1, "kc_gpu_0": 1}`: exactly one per worker node
and none on the head (which has CPUs but no `kc_gpu_*`), whatever the
coordinator counts.

What that means for the two scenarios:
* grow: the new node is counted at the coordinator's next tick, then by the
  policy's next look (its 1 s reservation cache); the controller shuts the 2
  workers down, starts 3 and they restore the checkpoint.
* shrink: the surviving ranks fail in their next all-reduce ~2..3 s after the
  kill (the killed node's worker outlives its raylet by 1..2 s and keeps
  stepping meanwhile). Ray Train restarts at once, but the coordinator still
  counts the dead node until the GCS marks it dead (after its own health
  checks fail for ~15 s: Ray Core's `health_check_period_ms` x
  `health_check_failure_threshold`, cluster settings left at their defaults
  on both systems' clusters) and a tick has seen that, so it first schedules
  the OLD size, 3, whose placement group can never be placed; each such try
  ends after RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (default 60 s, a bound on
  the placement-group wait alone: `WorkerGroup._start_impl`), counts as a
  controller failure (retried without limit:
  `FailureConfig.controller_failure_limit=-1`) and is tried again with a
  fresh count, which says 2 once the coordinator has seen the node die.

Settings used here (`SETTINGS`), each at its fastest working value:
* `RAY_TRAIN_HEALTH_CHECK_INTERVAL_S` = 0.1 s (default 2): how soon a failed
  worker is handled and the policy consulted (bench/recovery_rt.py explains
  why lower buys nothing).
* `RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S` = 5 s (default 600): the same
  budget as kuangchao's `heartbeat_timeout_s` in this benchmark.
* `RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S` = START_TIMEOUT_S = 2 s (default
  60): it bounds only the wait for the placement group, which for a size the
  cluster can hold is placed in well under a second here; a shorter bound
  retries the doomed size-3 group sooner after a node loss, and a too-short
  one only costs a retry, never the run.
* `ScalingConfig(elastic_resize_monitor_interval_s=0)` (default 60): the
  policy looks at every controller poll, limited by its own 1 s
  reservation-query cache (`ElasticScalingPolicy.GET_RESERVED_RESOURCES_INTERVAL_S`,
  a class constant left alone).
* The coordinator's tick, `_AutoscalingCoordinatorActor.TICK_INTERVAL_S` =
  TICK_S = 0.5 s (default 20): it has no setting, so `fast_coordinator()`
  creates the named detached actor Ray Train looks up
  (`get_or_create_autoscaling_coordinator`, `get_if_exists=True`) first,
  from a subclass that only changes that constant. A tick is one
  `ray.nodes()` and a resource request to the GCS; below 0.5 s it would
  gain little against the policy's 1 s cache.

`RAY_TRAIN_V2_ENABLED=1` must be set before `ray.train` is first imported;
this module sets it at its top. Run standalone (both scenarios on one fresh
cluster, results on stderr): .venv/bin/python bench/resize_rt.py
"""

from __future__ import annotations

import os

# Must precede any import of ray.train: selects the Train v2 API.
os.environ["RAY_TRAIN_V2_ENABLED"] = "1"

import json  # noqa: E402
import secrets  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from contextlib import nullcontext  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` when run as a script

import torch  # noqa: E402
from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (  # noqa: E402
    _AutoscalingCoordinatorActor,
)
from ray.train.v2._internal.execution.callback import ControllerCallback  # noqa: E402

from bench.harness import BenchCluster, _env, build_loop_parts, connect, log, tiny_spec  # noqa: E402
from bench.recovery_common import Background, wait_until  # noqa: E402
from bench.recovery_ray import Trace, ray_restore  # noqa: E402
from bench.recovery_rt import HEALTH_CHECK_S as _HEALTH_CHECK_S  # noqa: E402
from bench.resize_common import add_node, kill_node, leaf_nodes, node_of_pid  # noqa: E402
from kuangchao.platform.spec.jobspec import validate_spec  # noqa: E402
from kuangchao.workers.data.sampling import batch_indices  # noqa: E402

GLOBAL_BATCH = 48  # samples per optimizer step, whatever the world size (divisible by 1, 2, 3)
MICRO_BATCH = 8  # samples per rank per micro-step: accumulation = 48 / (8 * world)
CKPT_EVERY = 5  # steps between checkpoints (reported to Ray Train by every rank)
MONITOR_S = 0.0  # ScalingConfig(elastic_resize_monitor_interval_s=); Ray's default is 60
HEALTH_CHECK_S = _HEALTH_CHECK_S  # RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (0.1); Ray's default is 2
HEALTH_CHECK_TIMEOUT_S = 5.0  # RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S = our heartbeat_timeout_s here
START_TIMEOUT_S = 2.0  # RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S; Ray's default is 60
TICK_S = 0.5  # the AutoscalingCoordinator's TICK_INTERVAL_S; Ray's is 20 (no setting)
WAIT_S = 150.0  # longest wait for any one thing before the run is declared stuck
STOP_MARGIN = 4  # the bench ends a run this many steps past the newest one it saw
# Ray Train's settings for every run of this benchmark (environment variables Ray
# Train hands to its controller, and the rest), printed and put in the result lines.
SETTINGS: dict[str, Any] = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": HEALTH_CHECK_S,
    "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S": HEALTH_CHECK_TIMEOUT_S,
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": START_TIMEOUT_S,
    "ScalingConfig.elastic_resize_monitor_interval_s": MONITOR_S,
    "AutoscalingCoordinator.TICK_INTERVAL_S": TICK_S,
    "FailureConfig.max_failures": 3,
}
WORKER_RESOURCES = {"CPU": 1, "kc_gpu_0": 1}  # one worker per worker node, none on the head


# -- the loop the workers run -------------------------------------------------------

def resize_spec(steps: int) -> dict[str, Any]:
    """`tiny_spec` with the micro-batch of this benchmark (the model is unchanged)."""
    doc = tiny_spec(steps, name="bench-resize")
    doc["parallel"].update(micro_batch_size=MICRO_BATCH)
    doc["checkpoint"].update(interval_steps=CKPT_EVERY, keep_last=2)
    validate_spec(doc)
    return doc


def rt_loop(config: dict[str, Any]) -> None:
    """Ray Train's `train_loop_per_worker`, elastic: any world size dividing GLOBAL_BATCH.

    The world size comes from Ray Train's context, and gradient accumulation
    keeps the global batch at GLOBAL_BATCH, so step `s` consumes the same
    samples (`batch_indices`) at 2 or 3 workers. Resumes from
    `ray.train.get_checkpoint()` (a resize restarts the whole group) and
    reports a checkpoint every CKPT_EVERY steps. Trace lines in
    `{trace}/rank{r}.jsonl` (appended across restarts): `start` (resumed
    step), `step` after each optimizer step (`step` = index of the completed
    step, from 0), `ckpt` once the report returned; all carry `world`.

    config: {"spec": spec document, "trace": folder}.
    """
    import ray.train

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    spec = validate_spec(config["spec"])
    micro = spec.parallel.micro_batch_size
    if GLOBAL_BATCH % (micro * world):
        raise ValueError(f"global batch {GLOBAL_BATCH} does not split over {world} x {micro}")
    accum = GLOBAL_BATCH // (micro * world)
    trace = Trace(config["trace"], rank)
    try:
        t_start = time.time()
        model, ddp, optimizer, source = build_loop_parts(spec, world)
        t_built = time.time()
        start = ray_restore(model, optimizer)
        trace.write("start", step=start, world=world, accum=accum, t=t_start, built=t_built,
                    restored=time.time())
        steps = spec.training.steps
        for step in range(start, steps):
            for m in range(accum):
                x, y = source.get(batch_indices(step, m, rank, world, micro, accum))
                # Gradients are all-reduced once per step, on the last micro-step.
                sync = ddp.no_sync() if world > 1 and m < accum - 1 else nullcontext()
                with sync:
                    _, loss = ddp(x, y)
                    (loss / accum).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            trace.write("step", step=step, world=world)
            stop = stop_at(config["trace"])
            if stop is not None and step + 1 >= stop:
                break
            if (step + 1) % CKPT_EVERY == 0 and step + 1 < steps:
                t0 = time.time()
                _save(rank, step + 1, model, optimizer)
                trace.write("ckpt", step=step + 1, world=world, save_s=time.time() - t0)
    finally:
        trace.close()


def stop_at(folder: str | Path) -> int | None:
    """The step count the bench wants the run to end at (`{trace}/stop`), if it said.

    Every rank reads it after each step and ends after the same step, so the
    run finishes normally (no all-reduce left waiting) as soon as the bench has
    what it measures, instead of training to a step count guessed in advance."""
    try:
        return int((Path(folder) / "stop").read_text())
    except (FileNotFoundError, ValueError):
        return None


def request_stop(folder: Path) -> int:
    """Ask the run to end STOP_MARGIN steps past the newest step any rank traced."""
    stop = _last_step(folder) + 1 + STOP_MARGIN
    tmp = folder / "stop.tmp"
    tmp.write_text(str(stop))
    tmp.rename(folder / "stop")
    return stop


class FastTickCoordinator(_AutoscalingCoordinatorActor):
    """Ray Data's AutoscalingCoordinator with its tick at TICK_S instead of 20 s."""

    TICK_INTERVAL_S = TICK_S

    def tick_interval_s(self) -> float:
        return self.TICK_INTERVAL_S


def fast_coordinator() -> float:
    """Create the coordinator Ray Train will look up, ticking every TICK_S; returns
    the tick of the coordinator now registered (another, older one would win).

    Same name, namespace, options and node as `get_or_create_autoscaling_coordinator`
    (ray/data/_internal/cluster_autoscaler/default_autoscaling_coordinator.py).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(
        FastTickCoordinator).options(
        name="AutoscalingCoordinator", namespace="AutoscalingCoordinator", get_if_exists=True,
        lifetime="detached", scheduling_strategy=NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False)).remote()
    try:
        return float(ray.get(actor.tick_interval_s.remote(), timeout=60))
    except AttributeError:
        return float(_AutoscalingCoordinatorActor.TICK_INTERVAL_S)


def _save(rank: int, next_step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Ray Train's idiom: every rank reports (a barrier), rank 0 with the checkpoint,
    which Ray persists to storage_path before report returns."""
    import ray.train

    if rank != 0:
        ray.train.report({"step": next_step})
        return
    with tempfile.TemporaryDirectory() as d:
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": next_step},
                   Path(d) / "state.pt")
        ray.train.report({"step": next_step}, checkpoint=ray.train.Checkpoint.from_directory(d))


# -- Ray Train's decisions ------------------------------------------------------------

class ControllerTrace(ControllerCallback):
    """Appends the controller's state changes to a jsonl file, with `time.time()`.

    Runs inside Ray Train's controller actor (on the driver's node, this
    machine, so the clocks agree). One line per change of state type, plus
    each Scheduling/Resizing state with the number of workers decided.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def after_controller_state_update(self, previous_state: Any, current_state: Any) -> None:
        prev, cur = type(previous_state).__name__, type(current_state).__name__
        decision = getattr(current_state, "scaling_decision", None)
        if prev == cur and decision is None:
            return  # RunningState -> RunningState after every poll
        line = {"t": time.time(), "from": prev, "to": cur,
                "workers": getattr(decision, "num_workers", None)}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


# -- reading the traces -----------------------------------------------------------------

def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Complete lines of a jsonl file (a line being written is skipped)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1] if line]


def rank_events(folder: Path) -> list[dict[str, Any]]:
    """Every rank's trace events, in time order."""
    out = [e for p in sorted(folder.glob("rank*.jsonl")) for e in read_jsonl(p)]
    return sorted(out, key=lambda e: e["t"])


def first_step_at(events: list[dict[str, Any]], world: int, after: float) -> dict[str, Any] | None:
    """The first step completed by ALL ranks of a `world`-sized group started after `after`:
    rank 0's first such step, stamped with the latest rank's time for it."""
    started = [e for e in events if e["ev"] == "start" and e["world"] == world and e["t"] > after]
    if not started:
        return None
    pids = {e["pid"] for e in started}
    steps = [e for e in events if e["ev"] == "step" and e["pid"] in pids]
    first = next((e for e in steps if e["rank"] == 0), None)
    if first is None:
        return None
    same = [e for e in steps if e["step"] == first["step"]]
    if len(same) < world:
        return None  # not all ranks are through it yet
    return {**first, "t": max(e["t"] for e in same)}


def reached(events: list[dict[str, Any]], world: int, step: int) -> dict[str, Any] | None:
    """Rank 0's first step >= `step` at world size `world`."""
    return next((e for e in events if e["ev"] == "step" and e["rank"] == 0 and e["world"] == world
                 and e["step"] >= step), None)


def step_counts(events: list[dict[str, Any]]) -> Counter:
    """How often each global step was completed (rank 0's lines: DDP keeps ranks in step)."""
    return Counter(e["step"] for e in events if e["ev"] == "step" and e["rank"] == 0)


# -- the runs ---------------------------------------------------------------------------

def ray_trainer(cluster: BenchCluster, doc: dict[str, Any], folder: Path, name: str,
                max_workers: int):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from bench.resize_rt import ControllerTrace as Callback  # by name, not `__main__`
    from bench.resize_rt import rt_loop

    return TorchTrainer(
        rt_loop,
        train_loop_config={"spec": doc, "trace": str(folder)},
        scaling_config=ScalingConfig(num_workers=(1, max_workers), use_gpu=False,
                                     resources_per_worker=dict(WORKER_RESOURCES),
                                     label_selector={"kc.io/leaf": "leaf-0"},
                                     elastic_resize_monitor_interval_s=MONITOR_S),
        run_config=RunConfig(storage_path=str(cluster.tmp / "ray-train"), name=name,
                             failure_config=FailureConfig(max_failures=3),
                             checkpoint_config=CheckpointConfig(num_to_keep=2),
                             callbacks=[Callback(str(folder / "controller.jsonl"))]),
    )


def ray_resize(cluster: BenchCluster, kind: str, steps: int = 100_000,
               warmup_steps: int = CKPT_EVERY + 2, after_steps: int = CKPT_EVERY) -> dict[str, Any]:
    """Resize a running Ray Train v2 elastic job by one node; what the traces say.

    shrink: the job starts on all live worker nodes (n), one node is killed.
    grow: the job starts on the n live worker nodes, allowed n + 1 workers,
    and one node joins. The event comes once the job has trained
    `warmup_steps` at its first size (so a checkpoint exists). Once every rank
    has completed a step at the new size and rank 0 `after_steps` more (or the
    resize did not come within WAIT_S), the bench asks the run to stop
    (`request_stop`) and waits for fit() to return. SETTINGS apply; call
    `fast_coordinator()` once per cluster before the first run.

    Returns:
        {"kind", "from_world", "to_world", "resize_s" (event -> first step at
        the new size completed on every rank), "decision_s" (Ray Train's
        decision -> that step, None if not recorded), "samples_lost" ((steps
        before the stop never completed) * GLOBAL_BATCH), "steps_redone"
        (completions of a step beyond its first, summed), "phases" (event ->
        decision / group running / loop start / first step), "decisions" (the
        sizes the controller scheduled, in order), and a "note" when the
        resize did not happen as expected.}
    """
    if kind not in ("shrink", "grow"):
        raise ValueError(f"kind must be shrink or grow, not {kind!r}")
    connect(cluster)
    nodes = leaf_nodes()
    n = len(nodes)
    from_world, to_world = n, (n - 1 if kind == "shrink" else n + 1)
    if to_world < 1 or GLOBAL_BATCH % (MICRO_BATCH * max(from_world, to_world)):
        raise ValueError(f"cannot {kind} from {n} worker nodes with global batch {GLOBAL_BATCH}")
    folder = cluster.tmp / f"rt-resize-{kind}-{secrets.token_hex(3)}"
    folder.mkdir(parents=True)
    doc = resize_spec(steps)
    trainer = ray_trainer(cluster, doc, folder, folder.name, max(from_world, to_world))
    env = {k: str(v) for k, v in SETTINGS.items() if k.startswith("RAY_TRAIN_")}
    first: dict[str, Any] | None = None
    # fit() hands these to its controller actor when it starts; set for the whole run.
    with _env(**env):
        run = Background(trainer.fit, f"ray-train-{kind}")
        try:
            try:
                warm = wait_until(lambda: reached(rank_events(folder), from_world, warmup_steps),
                                  WAIT_S, f"{warmup_steps} steps at world size {from_world}",
                                  run.alive, poll_s=0.05)
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}: fit() raised {run.error!r}") from run.error
            if warm is None:
                raise TimeoutError(f"Ray Train did not reach step {warmup_steps} at world size "
                                   f"{from_world} within {WAIT_S:.0f}s")
            t_event, what, victim = _resize_event(cluster, kind, folder, nodes, from_world)
            log(f"ray-train {kind}: {what} at step {_last_step(folder)}")
            try:
                first = wait_until(lambda: first_step_at(rank_events(folder), to_world, t_event),
                                   WAIT_S, f"a step at world size {to_world}", run.alive,
                                   poll_s=0.05)
                if first is not None:
                    wait_until(lambda: reached(rank_events(folder), to_world,
                                               first["step"] + after_steps),
                               WAIT_S, f"{after_steps} more steps at world size {to_world}",
                               run.alive, poll_s=0.05)
            except RuntimeError as exc:  # the run ended first (wait_until raises when it does)
                log(f"ray-train {kind}: {exc}")
        finally:
            # The steps samples_lost covers: up to the stop asked for, or (the run
            # ended on its own: it failed) up to the newest step any rank traced.
            stop = request_stop(folder) if run.alive() else _last_step(folder) + 1
            run.join(WAIT_S, "Ray Train's fit()")
    if run.error is not None:
        log(f"ray-train {kind}: fit() raised {type(run.error).__name__}: {run.error}")
    return analyse(folder, kind, from_world, to_world, stop, t_event, first, run.error, victim)


def _resize_event(cluster: BenchCluster, kind: str, folder: Path, nodes: list[dict[str, Any]],
                  world: int) -> tuple[float, str, int | None]:
    """Kill the node of the highest rank (shrink) or add a node like the others (grow);
    when (kill: just before the signal; join: alive in `ray.nodes()`), what, and
    the pid of the rank on the killed node."""
    if kind == "shrink":
        # The running group's ranks are the last `world` loop starts.
        starts = [e for e in rank_events(folder) if e["ev"] == "start"][-world:]
        top = max(starts, key=lambda e: e["rank"])
        node_id = node_of_pid(top["pid"])
        if node_id is None:
            raise RuntimeError(f"no raylet above rank {top['rank']}'s pid {top['pid']}")
        return (kill_node(node_id), f"SIGKILL raylet of node {node_id[:8]} (rank {top['rank']})",
                top["pid"])
    cpus = int(nodes[0]["Resources"].get("CPU", 1))
    gpus = int(nodes[0]["Resources"].get("GPU", 0))
    name = f"node-{len(leaf_nodes(alive=False))}"
    node_id, joined = add_node(cluster, name, cpus, gpus)
    return joined, f"{name} ({node_id[:8]}) joined", None


def _last_step(folder: Path) -> int:
    return max((e["step"] for e in rank_events(folder) if e["ev"] == "step"), default=-1)


def analyse(folder: Path, kind: str, from_world: int, to_world: int, steps: int, t_event: float,
            first: dict[str, Any] | None, error: BaseException | None,
            victim: int | None = None) -> dict[str, Any]:
    """Turn the rank and controller traces of one run into the result dict.

    For a shrink, `victim_last_s` is when the rank on the killed node last
    wrote to its trace, after the kill: its process outlives its raylet a little.
    """
    events = rank_events(folder)
    ctl = read_jsonl(folder / "controller.jsonl")
    counts = step_counts(events)
    done = {s for s in counts if 0 <= s < steps}
    out: dict[str, Any] = {
        "kind": kind, "from_world": from_world, "to_world": to_world, "resize_s": None,
        "decision_s": None, "samples_lost": (steps - len(done)) * GLOBAL_BATCH,
        "steps_redone": sum(c - 1 for c in counts.values()),
        "decisions": [c["workers"] for c in ctl if c["to"] == "SchedulingState"],
        "event_t": t_event,
    }
    if victim is not None:
        last = max((e["t"] for e in events if e["pid"] == victim), default=t_event)
        out["victim_last_s"] = round(last - t_event, 3)
    if error is not None:
        out["error"] = f"{type(error).__name__}: {str(error)[:300]}"
    if first is None:
        out["note"] = (f"no step at world size {to_world} after the {kind} event; controller "
                       f"states: {[(round(c['t'] - t_event, 2), c['to'], c['workers']) for c in ctl]}")
        return out
    t_first = first["t"]
    out["resize_s"] = round(t_first - t_event, 3)
    # The decision that produced the new size: grow enters ResizingState while the
    # group is healthy; shrink schedules the smaller group after the failure.
    state = "ResizingState" if kind == "grow" else "SchedulingState"
    dec = [c for c in ctl if c["to"] == state and c["workers"] == to_world
           and t_event - 1 < c["t"] <= t_first]
    running = [c for c in ctl if c["to"] == "RunningState" and t_event < c["t"] <= t_first]
    failed = [c for c in ctl if c["to"] == "RestartingState" and t_event < c["t"] <= t_first]
    start = next(e for e in events if e["ev"] == "start" and e["pid"] == first["pid"])
    if dec:
        out["decision_s"] = round(t_first - dec[-1]["t"], 3)
    out["phases"] = {
        "failure_seen": round(failed[0]["t"] - t_event, 3) if failed else None,
        "decision": round(dec[-1]["t"] - t_event, 3) if dec else None,
        "group_running": round(running[-1]["t"] - t_event, 3) if running else None,
        "loop_start": round(start["t"] - t_event, 3),
        "restored": round(start["restored"] - t_event, 3),
        "first_step": out["resize_s"],
    }
    out["resumed_step"] = start["step"]
    out["first_new_step"] = first["step"]
    return out


def main() -> None:
    """Both scenarios once, on one fresh cluster: shrink 3 -> 2, then grow 2 -> 3 by adding a node."""
    from bench.harness import local_cluster

    with local_cluster(nodes=3, gpus=4, cpus=2) as cluster:
        connect(cluster)
        log(f"AutoscalingCoordinator tick {fast_coordinator()}s; settings {SETTINGS}")
        # Shrink first: its 3 -> 2 leaves the 2 worker nodes grow starts from.
        for kind in ("shrink", "grow"):
            t0 = time.monotonic()
            res = ray_resize(cluster, kind)
            log(f"ray-train {kind} ({time.monotonic() - t0:.0f}s): {json.dumps(res)}")


if __name__ == "__main__":
    main()
