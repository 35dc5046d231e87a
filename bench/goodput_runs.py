"""The two systems of bench/goodput.py, each at its fast-recovery settings, driven the
same way: a chaos run (the fault schedule until the job ends), a fault-free
reference run of the same job, and a kill series (rank 1 SIGKILLed again and again,
for `survivor_stall_s`).

kuangchao runs the `kc train` way (`run_as_driver` in a thread of this process,
bench/recovery_kc.py's `_start_kc`), with the built-in trainer, the job's model from
the factory `bench.goodput_ray:gpt` (the built-in GPT, plus the bench's NaN trigger
and step trace) and the settings docs/fault-tolerance.md recommends for fast
recovery (`OURS_FT`, `IN_MEMORY`). Ray Train v2 runs `bench.goodput_ray.rt_loop`
with TorchTrainer at the settings in `RT_ENV` and `rt_configs`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.goodput_chaos import (
    Chaos,
    Fault,
    Injected,
    RunFacts,
    Step,
    Trace,
    analyse,
    survivor_stall,
)
from bench.goodput_ray import DIR_ENV
from bench.harness import REPO_ROOT, BenchCluster, _env, log, tiny_spec, wait_for_quiet
from bench.recovery_common import Background, wait_until
from bench.recovery_kc import _find_job, _store
from kuangchao.platform.spec.jobspec import validate_spec

# kuangchao's settings for fast recovery (docs/fault-tolerance.md): beats every 0.5 s, a
# rank silent for 5 s is failed, and one silent for 2 s while every other rank waits on it
# (its peers' stalled collective confirms it: Ray Train has no such rule, and keeps the
# 5 s), a warm spare per node, restarts without a practical limit (the chaos run makes dozens).
OURS_FT: dict[str, Any] = {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 5.0,
                           "peer_wait_timeout_s": 2.0, "spare_workers": True, "standby_spares": 1,
                           "max_restarts": 10_000}
# Peer-memory copies at every step (issue 28), on one other node.
IN_MEMORY: dict[str, Any] = {"interval_steps": 1, "replicas": 1, "max_mb_per_rank": 256}
KC_DRAIN_POLL_S = 1.0  # platform/execution/drain.py DRAIN_POLL_S: how often kc reads the drain table
# Ray Train v2's failure handling, tuned to kuangchao's detection budget: controller poll
# 0.1 s (default 2; bench/recovery_rt.py says why lower buys nothing), a worker whose poll
# hangs 5 s is dead (= heartbeat_timeout_s; default 600), drain notices read every 1 s
# (= kc's drain poll; default 5), a worker group that cannot be placed retried after 2 s
# (default 60: a group placed on a node that died but is not yet declared dead).
RT_ENV: dict[str, float] = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": 0.1,
    "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S": OURS_FT["heartbeat_timeout_s"],
    "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": KC_DRAIN_POLL_S,
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": 2.0,
}
TORCHFT_TIMEOUT_S = OURS_FT["heartbeat_timeout_s"]  # torchft: collective/commit timeout, lighthouse heartbeat
TORCHFT_PATH_ENV = "KCBENCH_TORCHFT_PATH"  # a site-packages folder holding torchft (not a dependency)
# fit() reruns at most (see RayTrain._fit): a run that keeps failing at once is reported,
# not retried forever.
RT_MAX_RERUNS = 5
RT_PREEMPT_EVERY = 5  # steps between the loop's get_preemption_info() calls (a barrier)
RT_WORKER = {"CPU": 1, "kc_gpu_0": 1}  # one worker per worker node (1 GPU each), none on the head
WAIT_S = 300.0  # longest wait for any one thing before a run is declared stuck
# Before each run, the machine quiet again (bench/report.py's wait_for_quiet, as the other
# benches do between runs): the processes of the run before it (its ranks, spares and
# keepers, a node that came back) exit or settle after it ends, and on one machine standing
# for four nodes their teardown would be billed to the next run's first minute.
QUIET_WAIT_S = 60.0
MODEL_FACTORY = "bench.goodput_ray:gpt"


def rt_configs(ckpt_every: int, torchft: bool = False) -> dict[str, Any]:
    """Ray Train's settings besides RT_ENV, as printed and put in the lines."""
    out = {"FailureConfig.max_failures": -1, "FailureConfig.max_preemption_failures": -1,
           "CheckpointConfig.num_to_keep": 2, "report every (steps)": ckpt_every,
           "ScalingConfig": f"num_workers=2, use_gpu=False, resources_per_worker={RT_WORKER}"}
    if torchft:
        return {**out, "TorchftConfig": f"backend=gloo, lighthouse_kwargs={torchft_lighthouse()} "
                                        "(its lighthouse actor on no CPU: bench/goodput_torchft.py)",
                "torchft.Manager": f"min_replica_size=1, timeout={TORCHFT_TIMEOUT_S}s, "
                                   "ProcessGroupGloo, PGTransport, init_sync=False",
                "replica groups": "one per worker (Ray Train's torchft layout)"}
    return {**out, "checkpoint_upload_mode": "ASYNC",
            "get_preemption_info() every (steps)": RT_PREEMPT_EVERY}


def torchft_lighthouse() -> dict[str, Any]:
    """The lighthouse's settings: a quorum of one replica is enough, a replica silent for
    the detection budget is out, a new quorum forms without waiting for stragglers."""
    return {"min_replicas": 1, "join_timeout_ms": 100,
            "heartbeat_timeout_ms": int(TORCHFT_TIMEOUT_S * 1000)}


def torchft_path() -> str | None:
    """Where torchft is, when this process can import it (with KCBENCH_TORCHFT_PATH added);
    that folder goes on the workers' PYTHONPATH."""
    import importlib.util
    import sys

    extra = os.environ.get(TORCHFT_PATH_ENV)
    if extra and extra not in sys.path:
        sys.path.append(extra)
    found = importlib.util.find_spec("torchft")
    if found is None or not found.origin:
        return None
    return str(Path(found.origin).parent.parent)


def connect(cluster: BenchCluster, folder: Path, extra_path: str | None = None) -> None:
    """Join the cluster as the Ray driver (as `bench.harness.connect`), with the trace
    folder in the runtime env every worker of both systems inherits (and `extra_path`,
    torchft's folder, on their PYTHONPATH)."""
    import logging

    import ray

    from kuangchao.platform.runtime import ray_connect
    from kuangchao.platform.settings import RAY_NAMESPACE

    if ray.is_initialized():
        return
    ray_connect.connect(cluster.ray_address, namespace=RAY_NAMESPACE, logging_level=logging.ERROR,
                        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                            p for p in (str(REPO_ROOT), extra_path) if p),
                                                  DIR_ENV: str(folder)}})


def job_doc(steps: int, ckpt_every: int, name: str, in_memory: bool,
            skip: list[int] | None = None) -> dict[str, Any]:
    """The job both systems train: bench/harness.py's tiny_spec (the model and batch of
    bench/recovery.py), fixed at 2 data-parallel ranks, with the built-in trainer.

    `skip`: batches kuangchao's fault-free reference skips as its chaos run did (a
    numeric rollback skips the batch that gave the NaN); its own drill
    (`fault_tolerance.inject_nan_at_batches`) makes the reference skip the same ones."""
    doc = tiny_spec(steps, name=name)
    doc.pop("entrypoint", None)
    doc.pop("args", None)
    doc["model"]["type"] = MODEL_FACTORY
    doc["checkpoint"].update(interval_steps=ckpt_every, keep_last=2)
    if in_memory:
        doc["checkpoint"]["in_memory"] = dict(IN_MEMORY)
    doc["fault_tolerance"] = {**doc.get("fault_tolerance", {}), **OURS_FT}
    if skip:
        doc["fault_tolerance"]["inject_nan_at_batches"] = list(skip)
    validate_spec(doc)
    return doc


def in_memory_accepted() -> tuple[bool, str]:
    """Whether this checkout's spec takes `checkpoint.in_memory` (issue 28, being wired)."""
    try:
        job_doc(10, 5, "probe", in_memory=True)
    except Exception as exc:
        return False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return True, ""


@dataclass
class Run:
    """One run of one system: its trace window and what it did."""

    system: str  # "kc" or "rt"
    label: str
    start: float
    end: float = 0.0
    total: int = 0
    steps: list[Step] = field(default_factory=list)
    facts: RunFacts = field(default_factory=RunFacts)
    injected: list[Injected] = field(default_factory=list)
    kills: list[tuple[float, int, int]] = field(default_factory=list)  # (time, pid, rank) per SIGKILL
    final_loss: float | None = None
    skipped: list[int] = field(default_factory=list)  # batches kc's numeric rollbacks skipped
    job: dict[str, Any] | None = None
    error: str | None = None


class System:
    """Starts and ends one run of a system; subclasses say how."""

    name = ""

    def __init__(self, cluster: BenchCluster, folder: Path, ckpt_every: int) -> None:
        self.cluster, self.folder, self.ckpt_every = cluster, folder, ckpt_every

    def start(self, doc: dict[str, Any], label: str) -> Background:
        raise NotImplementedError

    def stop(self, steps_done: int) -> None:
        """End an open-ended run (the kill series) soon."""
        raise NotImplementedError

    def finish(self, run: Run, bg: Background) -> None:
        """After the run: the final loss and whatever the system recorded."""
        raise NotImplementedError

    def settled(self) -> bool:
        """Whether the job is back at full strength after a recovery, beyond training
        again (the kill series waits for it before the next kill)."""
        return True


class Kuangchao(System):
    name = "kc"

    def start(self, doc: dict[str, Any], label: str) -> Background:
        """`run_as_driver` in a thread, as bench/recovery_kc.py's `_start_kc`, keeping the
        thread so that a driver that ends before its job is recorded says why."""
        from kuangchao.platform.runtime.driver import run_as_driver

        self.store = _store(self.cluster)
        since = time.time() - 1
        bg = Background(lambda: run_as_driver(doc, self.cluster.settings), "kc-driver")
        try:
            self.job_id = wait_until(lambda: _find_job(self.store, doc["task"]["name"], since),
                                     60, "the job", bg.alive)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}: run_as_driver raised {bg.error!r}") from bg.error
        if self.job_id is None:
            raise TimeoutError("the kuangchao job was not submitted within 60s")
        log(f"kuangchao {label}: job {self.job_id}")
        return bg

    def stop(self, steps_done: int) -> None:
        from kuangchao.platform.control import operations as jobs

        with contextlib.suppress(Exception):
            jobs.cancel(self.store, self.job_id)

    def settled(self) -> bool:
        """Every warm spare of the job up, the one started behind the spare a recovery
        used included (the job JSON's `spares`)."""
        return all(s.get("state") == "warm" for s in self.store.get(self.job_id).spares)

    def finish(self, run: Run, bg: Background) -> None:
        from kuangchao.platform.control import operations as jobs
        from kuangchao.platform.control.goodput import job_split

        record = self.store.get(self.job_id)
        view = jobs.job_view(self.store, record)
        run.job = view
        run.final_loss = view["progress"].get("loss")
        if view["state"] != ("CANCELLED" if run.kills and run.label == "kills" else "SUCCEEDED"):
            run.error = f"job {self.job_id} ended {view['state']}: {view.get('message')}"
        causes = [str(e.get("cause", "")) for e in view.get("restart_log") or []]
        run.skipped = sorted({int(m) for c in causes for m in re.findall(r"skipping batch (\d+)", c)})
        if run.skipped:
            log(f"kuangchao {run.label}: its numeric rollbacks skipped batches {run.skipped}")
        split = job_split(self.store, record)
        log(f"kuangchao {run.label}: job {self.job_id} {view['state']} after "
            f"{view.get('restarts')} restart(s), {view.get('preemptions', 0)} preemption(s); "
            f"final loss {run.final_loss}; the platform's own goodput: "
            + (json.dumps(split.to_json(), default=str) if split is not None else "none"))
        paths: dict[str, int] = {}
        for e in view.get("restart_log") or []:
            key = f"{e.get('kind')}/{e.get('path')}" + ("/spare" if e.get("spare") else "")
            paths[key] = paths.get(key, 0) + 1
        log(f"kuangchao {run.label}: recoveries by kind/path: {paths}")
        peer = sum("from peer memory" in str(ln.get("message", ""))
                   for ln in self.store.logs(self.job_id))
        log(f"kuangchao {run.label}: restores from peer memory (log lines): {peer}")
        # The job's events beside the step trace: the bench's Redis prefix goes with the
        # cluster, and `--keep-trace` keeps this folder for a diagnosis of the run.
        (self.folder / f"events-{run.label}-{self.job_id}.json").write_text(
            json.dumps(self.store.events(self.job_id), default=str))


class RayTrain(System):
    name = "rt"

    def __init__(self, cluster: BenchCluster, folder: Path, ckpt_every: int,
                 torchft: bool = False) -> None:
        super().__init__(cluster, folder, ckpt_every)
        self.torchft = torchft
        self.reruns: list[str] = []  # why each fit() ended early (see _fit)

    def start(self, doc: dict[str, Any], label: str) -> Background:
        from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        from bench.goodput_ray import rt_loop, rt_torchft_loop

        name = f"goodput-{label}-{int(time.time())}"  # Ray Train resumes a run whose name it saw
        self.stop_file = self.folder / f"{name}.stop"
        self.final_file = self.folder / f"{name}.final.json"
        extra: dict[str, Any] = {}
        if self.torchft:
            from bench.goodput_torchft import ZeroCpuTorchftConfig

            extra["torch_config"] = ZeroCpuTorchftConfig(lighthouse_kwargs=torchft_lighthouse(),
                                                         backend="gloo")

        def trainer() -> TorchTrainer:
            return TorchTrainer(
                rt_torchft_loop if self.torchft else rt_loop,
                train_loop_config={"spec": doc, "ckpt_every": self.ckpt_every,
                                   "preempt_every": RT_PREEMPT_EVERY, "stop": str(self.stop_file),
                                   "final": str(self.final_file), "timeout_s": TORCHFT_TIMEOUT_S},
                **extra,
                scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                             resources_per_worker=dict(RT_WORKER)),
                run_config=RunConfig(storage_path=str(self.cluster.tmp / "ray-train"), name=name,
                                     failure_config=FailureConfig(max_failures=-1,
                                                                  max_preemption_failures=-1),
                                     checkpoint_config=CheckpointConfig(num_to_keep=2)),
            )
        # fit() hands these to the controller it starts; kept set for the whole run.
        self._env = _env(**{k: str(v) for k, v in RT_ENV.items()})
        self._env.__enter__()
        log(f"ray-train {label}: run {name}")
        return Background(lambda: self._fit(trainer, label), f"ray-train-{label}")

    def _fit(self, trainer: Callable[[], Any], label: str) -> Any:
        """fit(), run again under the same run name when it raises before the run was told
        to stop: Ray Train then resumes from the run's newest checkpoint, which is its
        fault-tolerance guide's answer to a failed driver or controller (a raylet kill can
        end fit() with the controller unreachable, whatever max_failures says). The time
        between is the baseline's, lost like any other; each rerun is logged and counted."""
        while True:
            try:
                return trainer().fit()
            except Exception as exc:  # noqa: BLE001 -- any end of fit() but the stop's
                if self.stop_file.exists() or len(self.reruns) >= RT_MAX_RERUNS:
                    raise
                self.reruns.append(f"{type(exc).__name__}: {str(exc)[:200]}")
                log(f"ray-train {label}: fit() raised {self.reruns[-1]}; rerun "
                    f"{len(self.reruns)} under the same run name (resumes from its newest "
                    "checkpoint)")

    def stop(self, steps_done: int) -> None:
        tmp = self.stop_file.with_suffix(".tmp")
        tmp.write_text(str(steps_done + 3))
        tmp.rename(self.stop_file)

    def finish(self, run: Run, bg: Background) -> None:
        self._env.__exit__(None, None, None)
        try:
            run.final_loss = json.loads(self.final_file.read_text())["loss"]
        except (FileNotFoundError, ValueError, KeyError):
            run.final_loss = None
        log(f"ray-train {run.label}: fit() " + ("returned" if bg.error is None else
                                                 f"raised {type(bg.error).__name__}: {bg.error}")
            + f"; final loss {run.final_loss}; reruns of fit(): {len(self.reruns)}")


def _first_step(trace: Trace, start: float, bg: Background) -> float:
    try:
        got = wait_until(lambda: trace.window(start), WAIT_S, "the first step", bg.alive,
                         poll_s=0.1)
    except RuntimeError as exc:  # the run ended first: say how
        raise RuntimeError(f"{exc}; it ended with {bg.error!r}") from bg.error
    if not got:
        raise TimeoutError(f"no step within {WAIT_S:.0f}s of the start")
    return got[0].t


def _wind_up(system: System, trace: Trace, run: Run, bg: Background) -> None:
    """Whatever happened: end the run if it still goes, let the system say how it ended
    (final loss, errors, its own records), and read the trace."""
    if bg.alive():
        system.stop(0)
        with contextlib.suppress(TimeoutError):
            bg.join(120, f"{run.label} after its stop")
    run.end = time.time()
    try:
        system.finish(run, bg)
    except Exception as exc:  # noqa: BLE001 -- the run's own failure matters more
        log(f"{system.name} {run.label}: could not read how it ended: {type(exc).__name__}: {exc}")
    if bg.error is not None and run.error is None:
        run.error = f"{type(bg.error).__name__}: {str(bg.error)[:300]}"
    run.steps = trace.window(run.start, run.end)
    run.facts = analyse(run.steps, run.total)


def run_job(system: System, trace: Trace, doc: dict[str, Any], label: str,
            plan: list[Fault] | None = None, cpus: int = 2, gpus: int = 1,
            join_s: float = 3600.0) -> Run:
    """Run the job to its end, under the fault schedule `plan` when given."""
    wait_for_quiet(timeout_s=QUIET_WAIT_S)
    start = time.time()
    run = Run(system.name, label, start, total=doc["training"]["steps"])
    bg = system.start(doc, label)
    chaos = Chaos(system.cluster, trace, trace.folder, cpus=cpus, gpus=gpus)
    try:
        first = _first_step(trace, start, bg)
        if plan:
            chaos.run(plan, first, bg.alive, start)
        bg.join(join_s, f"{label}")
    finally:
        chaos.settle()
        run.injected = chaos.injected
        run.kills = [(f.t, f.pid, f.rank) for f in chaos.injected
                     if f.kind == "kill_rank" and f.pid is not None and f.t]
        _wind_up(system, trace, run, bg)
    return run


def kill_series(system: System, trace: Trace, doc: dict[str, Any], label: str, kills: int,
                victim: int = 1, gap_steps: int = 8) -> Run:
    """SIGKILL rank `victim` `kills` times, each once the process now holding it has
    completed `gap_steps` steps and the system is back at full strength (`settled`:
    kuangchao's warm spares all up again); then end the run.

    Each kill stands for one failure of the chaos run's kind, which come a minute
    apart: by then a system has long recovered whatever the last one used. Killing
    sooner (8 steps are 3 to 4 s here; the spare behind the one a kill used was up 8
    to 10 s after it, beside two training ranks on 2 cores) measured that spare's
    start-up instead of the recovery."""
    import signal

    wait_for_quiet(timeout_s=QUIET_WAIT_S)
    start = time.time()
    run = Run(system.name, label, start, total=doc["training"]["steps"])
    bg = system.start(doc, label)
    try:
        _first_step(trace, start, bg)
        after = start
        for i in range(kills):
            def ready(after: float = after) -> Step | None:
                mine = [s for s in trace.window(after) if s.rank == victim]
                if not mine:
                    return None
                pid = mine[-1].pid
                if sum(s.pid == pid for s in mine) < gap_steps or not system.settled():
                    return None
                return mine[-1]
            held = wait_until(ready, WAIT_S, f"rank {victim} to train {gap_steps} steps, "
                              f"{system.name} settled", bg.alive, poll_s=0.05)
            if held is None:
                raise TimeoutError(f"rank {victim} did not train {gap_steps} steps, or {system.name} "
                                   f"did not settle, within {WAIT_S:.0f}s")
            t = time.time()
            with contextlib.suppress(ProcessLookupError):
                os.kill(held.pid, signal.SIGKILL)
            run.kills.append((t, held.pid, victim))
            log(f"  kill {i + 1}/{kills}: SIGKILL rank {victim} pid {held.pid} after step {held.step}")
            after = t
        wait_until(lambda: [s for s in trace.window(after) if s.rank == victim], WAIT_S,
                   "the recovery from the last kill", bg.alive, poll_s=0.05)
        time.sleep(1.0)  # a few steps after it, for the stall's end
        done = max((s.step for s in trace.window(start)), default=0)
        system.stop(done)
        bg.join(WAIT_S, f"{label} after its stop")
    finally:
        _wind_up(system, trace, run, bg)
    return run


def stalls(run: Run) -> list[float]:
    """Each SIGKILL's survivor stall, from the trace (`survivor_stall`), up to the next
    fault or kill."""
    med = run.facts.median_step_s or 0.0
    marks = sorted([t for t, _, _ in run.kills] + [f.t for f in run.injected if f.t] + [run.end])
    out = []
    for t, _, victim in run.kills:
        until = next((m for m in marks if m > t), run.end)
        s = survivor_stall(run.steps, t, until, victim, med)
        if s is not None:
            out.append(s)
    return out


def kc_entry_stalls(run: Run) -> list[float]:
    """kuangchao's own `survivor_stall_s` of each kill's restart entry (live path), if any."""
    if not run.job:
        return []
    times = [t for t, _, _ in run.kills] + [float("inf")]
    out = []
    for k, (t, _, _) in enumerate(run.kills):
        hit = next((e for e in run.job.get("restart_log") or []
                    if t < float(e.get("failed_at") or 0) < times[k + 1]
                    and e.get("survivor_stall_s") is not None), None)
        if hit is not None:
            out.append(float(hit["survivor_stall_s"]))
    return out
