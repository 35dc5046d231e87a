"""One training process: the plain class behind each rank's Ray actor.

The controller creates one per rank inside the job's placement group, asks
each where it landed, forms the process group, then calls `run`. The class
takes no Ray dependency beyond reading its own node and GPU ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import re
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kuangchao.platform.cluster.topology import GPU_RESOURCE_PREFIX
from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.observability import metrics
from kuangchao.platform.protocol.generation import Generation
from kuangchao.platform.settings import Settings, checkpoint_roots
from kuangchao.platform.spec.jobspec import JobSpec, validate_spec
from kuangchao.platform.storage.access import use_job_credentials
from kuangchao.platform.storage.objects import StoreCredentials
from kuangchao.workers.checkpoint.manager import CheckpointManager
from kuangchao.workers.elastic.generation import join_generation
from kuangchao.workers.errors import EntrypointError, PlacementMismatch, TrainingError
from kuangchao.workers.parallel.emulation import check_emulation
from kuangchao.workers.parallel.layout import Layout
from kuangchao.workers.runtime import credentials, telemetry
from kuangchao.workers.runtime.context import TrainContext
from kuangchao.workers.runtime.credentials import GuardedCheckpoints, TokenHolder, authority_client
from kuangchao.workers.runtime.heartbeat import Heartbeat
from kuangchao.workers.runtime.joblog import capture_output
from kuangchao.workers.runtime.liveness import log_sink, start_heartbeat
from kuangchao.workers.runtime.telemetry import WorkerTelemetry
from kuangchao.workers.runtime.warm_up import settle_heap

_GPU_RESOURCE = re.compile(rf"^{GPU_RESOURCE_PREFIX}(\d+)(_group_.*)?$")


# The built-in trainer, named as a user's entrypoint is: the runtime runs a train
# function and never imports the trainer, which sits above it (the trainer takes
# a TrainContext from here); tests/unit/test_architecture.py keeps that order.
BUILTIN_TRAINER = "kuangchao.workers.trainer.loop:train"
# A user's function runs through this, which hands its context the platform's calls
# (ctx.prepare_model, ctx.resume, ...): named for the same reason.
OWN_FUNCTION_RUNNER = "kuangchao.workers.trainer.own:run_entrypoint"


def resolve_entrypoint(ref: str | None) -> Callable[[TrainContext], Any]:
    """The train function: the built-in trainer, or the user's `module:function`."""
    if ref is None:
        ref = BUILTIN_TRAINER
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise EntrypointError(
            f"entrypoint {ref!r}: cannot import module {module_name!r} on "
            f"{socket.gethostname()}: {type(exc).__name__}: {exc}. Make it importable on every "
            "node (install it, or submit with `ray job submit --working-dir DIR`)"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise EntrypointError(f"entrypoint {ref!r}: module {module_name!r} has no function {attr!r}")
    return fn


def granted_gpu_ids(assigned: dict[str, float]) -> list[int]:
    """GPU ids from Ray's assigned resources (`kc_gpu_3`, or `kc_gpu_3_group_0_<pg>`)."""
    ids = set()
    for name in assigned:
        m = _GPU_RESOURCE.match(name)
        if m:
            ids.add(int(m.group(1)))
    return sorted(ids)


def node_hardware(given: dict[str, Any] | None) -> dict[str, Any]:
    """This rank's node's `gpu_type` and `emulated_speed`, as the controller passed them;
    a rank started without the controller reads KC_GPU_TYPE and KC_EMULATED_SPEED."""
    if given is not None:
        return dict(given)
    speed = os.environ.get("KC_EMULATED_SPEED")
    try:
        emulated = float(speed) if speed else None
    except ValueError:
        raise TrainingError(f"KC_EMULATED_SPEED={speed!r}: give emulated_speed as a number in "
                            "(0, 1]") from None
    return {"gpu_type": os.environ.get("KC_GPU_TYPE") or None, "emulated_speed": emulated}


class TrainWorker:
    """Hosts one rank. Methods are called by the job controller in order:
    `describe`, `join`, `run`."""

    def __init__(self, job_id: str, rank: int, world_size: int, settings: Settings,
                 planned_gpus: tuple[int, ...] | None = None, node: str = "",
                 heartbeat: tuple[float, float] | None = None,
                 grant: dict[str, Any] | None = None, authority: Any = None,
                 hardware: dict[str, Any] | None = None) -> None:
        self.job_id, self.rank, self.world_size = job_id, rank, world_size
        self.hardware = hardware
        if grant is not None and grant.get("redis_url"):
            # The job's own Redis user: this process never holds the admin credentials.
            settings = dataclasses.replace(settings, redis_url=grant["redis_url"])
        if grant is not None:  # its job's object-store credentials (or none), never its node's
            use_job_credentials(StoreCredentials.from_json(grant["storage"])
                                if grant.get("storage") else None)
        self.settings = settings
        self.planned_gpus = planned_gpus
        self.store: JobStore | None = None
        if settings.redis_url:
            self.store = JobStore.from_url(settings.redis_url, settings.redis_prefix)
        self.sink = log_sink(self.store, settings, job_id, rank, heartbeat)
        self.node = node or socket.gethostname()
        # The tokens first: the metrics endpoint starts under the monitor token.
        self.holder = self._hold(grant, authority) if grant is not None else None
        self.telemetry = self._serve_metrics(node)
        self.generation: Generation | None = None
        self._group_store: Any = None
        # Beats start with the process, so even a hang in start-up is seen; they hold
        # this process's lease (workers/fence.py).
        self.heartbeat: Heartbeat | None = start_heartbeat(
            settings, job_id, rank, self.node, heartbeat, self.sink, self.store, self.telemetry,
            lambda: self.generation.gen if self.generation else 0)

    def _serve_metrics(self, node: str) -> WorkerTelemetry | None:
        """This rank's Prometheus endpoint, registered for the control plane's file_sd."""
        if not telemetry.enabled():
            return None
        if self.holder is not None:
            try:  # the endpoint, and `kc debug`'s views behind it, are the monitor's
                self.holder.permit_module("monitor", "metrics_read", "metrics/endpoint")
            except PermissionError as exc:  # reported; training goes on without them
                self.sink.emit(f"worker metrics endpoint not started: {exc}", level="WARNING",
                               module="telemetry")
                return None
        tel = WorkerTelemetry(self.job_id, self.rank, node or socket.gethostname())
        try:
            import ray

            host = os.environ.get(telemetry.ADDR_ENV) or ray.util.get_node_ip_address()
            tel.serve(host)
        except Exception as exc:  # noqa: BLE001 -- training goes on without its endpoint
            self.sink.emit(f"worker metrics endpoint did not start: {exc}", level="WARNING",
                           module="telemetry")
            return tel
        if self.store is not None:
            telemetry.register(self.store, tel)
        return tel

    def _hold(self, grant: dict[str, Any], authority: Any) -> TokenHolder:
        """Verify and keep this rank's token; refusals go to the job's events and the audit."""
        renew, report = authority_client(authority)
        store = self.store

        def revoked(token_id: str) -> bool:
            return store is not None and store.token_revoked(token_id)

        def denied(interface: str, resource: str, reason: str) -> None:
            message = f"rank {self.rank} was refused {interface} on {resource}: {reason}"
            self.sink.emit(message, level="ERROR", module="permission")
            report(holder.token if holder else grant["token"], interface, resource, reason)
            if store is not None:
                try:
                    store.add_event(self.job_id, {"ts": time.time(), "type": "permission_denied",
                                                  "rank": self.rank, "interface": interface,
                                                  "resource": resource, "message": message})
                except Exception:  # the raised PermissionError still fails the rank
                    pass

        holder: TokenHolder | None = None
        holder = TokenHolder(grant["token"], grant["public_key"], revoked, renew, denied,
                             modules=grant.get("modules") or {})
        if grant.get("storage") and authority is not None:
            credentials.renew_storage_in_background(holder, authority, holder._stop)
        return holder

    def describe(self) -> dict[str, Any]:
        """Where this rank landed: host, IP, pid, and the GPU ids it was given.

        On nodes with per-GPU resources the plan's GPU ids are checked against
        the `kc_gpu_N` resources Ray granted, and the process is limited to
        exactly those GPUs; a mismatch fails the job before any work starts.
        The GPUs it takes are checked against its token's device scope too.

        Raises:
            PlacementMismatch: When Ray granted other GPUs than planned.
            PermissionError: When the token's device scope is not those GPUs.
        """
        import ray

        ctx = ray.get_runtime_context()
        ray_ids = [int(g) for g in ray.get_gpu_ids()]
        gpu_ids = ray_ids
        if self.planned_gpus is not None:
            granted = granted_gpu_ids(ctx.get_assigned_resources())
            if sorted(granted) != sorted(self.planned_gpus):
                raise PlacementMismatch(
                    f"rank {self.rank}: planned GPUs {list(self.planned_gpus)} but Ray granted "
                    f"{granted} on {socket.gethostname()}")
            gpu_ids = list(self.planned_gpus)
            self._check_devices(gpu_ids, planned=True)
            # Before CUDA initialises: this process sees exactly the planned GPUs.
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids))
        else:  # a node without per-GPU resources: Ray picked them (CUDA_VISIBLE_DEVICES)
            self._check_devices(gpu_ids, planned=False)
        return self._where(gpu_ids, ray_ids)

    def _check_devices(self, gpu_ids: list[int], planned: bool) -> None:
        """Where the rank takes its GPUs: they must be its token's device scope."""
        if self.holder is not None:
            self.holder.check_devices(gpu_ids, planned)

    def _where(self, gpu_ids: list[int], ray_ids: list[int]) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        self.sink.emit(f"rank {self.rank} on {socket.gethostname()} pid {os.getpid()} "
                       f"gpus {gpu_ids}", module="worker", gpu_ids=gpu_ids, ray_gpu_ids=ray_ids)
        return {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                "ip": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id(),
                "gpu_ids": gpu_ids, "ray_gpu_ids": ray_ids}

    def join(self, generation: dict[str, Any], rank: int | None = None,
             timeout_s: float = 300.0) -> str:
        """Join the process group of `generation` (as the controller published it):
        NCCL with CUDA, else gloo, at the rendezvous the controller hosts."""
        gen = Generation.from_json(generation)
        if gen.host.startswith("127.") and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        self.rank = self.rank if rank is None else rank
        self.world_size, self.generation = gen.world_size, gen
        if self.heartbeat is not None:
            self.heartbeat.rename(self.rank)
        self.sink.rank = self.rank
        if self.telemetry is not None and self.telemetry.rank != self.rank:
            if self.store is not None:
                telemetry.unregister(self.store, self.telemetry)
            self.telemetry.rank = self.rank
            if self.store is not None:
                telemetry.register(self.store, self.telemetry)
        backend, self._group_store = join_generation(gen, self.rank, timeout_s)
        return backend

    def run(self, spec_doc: dict[str, Any], keepers: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run the train function; on failure raise `TrainingError` with the traceback.
        `keepers`: the job's peer-memory keepers (`KeeperPlan.to_json()`), or None."""
        spec = validate_spec(spec_doc)
        torch.set_num_threads(spec.training.torch_threads)
        with capture_output(self.sink):
            try:
                ctx = self._context(spec)
                ctx.keepers = keepers
                fn = resolve_entrypoint(spec.entrypoint)
                settle_heap()  # the imports made, the train function's own included
                if spec.entrypoint is None:
                    result = fn(ctx)
                else:
                    result = resolve_entrypoint(OWN_FUNCTION_RUNNER)(ctx, fn)
                if isinstance(result, dict) and result.get("left") and self.heartbeat is not None:
                    self.heartbeat.stop(delete=False)  # this rank is out of the job
                    self.heartbeat = None
                return result if isinstance(result, dict) else {"result": result}
            except Exception as exc:
                tb = traceback.format_exc()
                self.sink.emit(tb, level="ERROR", module="worker")
                # A token refusal reads as what it is to the user: a PermissionError.
                kind = "PermissionError" if isinstance(exc, PermissionError) else type(exc).__name__
                message = exc.message if isinstance(exc, EntrypointError) else (
                    f"rank {self.rank} on {socket.gethostname()}: {kind}: {exc}")
                raise TrainingError(f"{message}\n{tb}") from None
            finally:
                if self.heartbeat is not None:
                    self.heartbeat.set_phase("done")
                    self.heartbeat.flush()
                self.sink.flush()

    def _context(self, spec: JobSpec) -> TrainContext:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        on_commit = self._record_checkpoint if self.store else None
        args = (spec.checkpoint.path, self.job_id, self.rank, self.world_size, spec.spec_hash(),
                spec.checkpoint.keep_last)
        # The API checked checkpoint.path against the roots as written; where it leads
        # (symlinks followed) is checked here, on this node, before each save and load.
        kw = {"on_commit": on_commit, "roots": checkpoint_roots(),
              "local_staging": spec.checkpoint.local_staging, "on_event": self._checkpoint_event}
        ckpt = (GuardedCheckpoints(*args, **kw, holder=self.holder)
                if self.holder is not None else CheckpointManager(*args, **kw))
        gen = self.generation
        rng = spec.elastic_range
        replicas = self.world_size // rng.ranks_per_replica
        coords = Layout.of(spec.parallel, self.world_size).coords(self.rank)
        hw = node_hardware(self.hardware)
        speed = check_emulation(hw.get("emulated_speed"), torch.cuda.is_available(), self.node)
        return TrainContext(job_id=self.job_id, rank=self.rank, world_size=self.world_size,
                            local_rank=0, spec=spec, device=device, checkpoint=ckpt,
                            sink=self.sink, store=self.store, dp_rank=coords.dp,
                            dp_size=replicas, heartbeat=self.heartbeat, node=self.node,
                            started_at=time.time(),
                            accum_steps=gen.accum if gen else rng.accumulation(replicas),
                            generation=gen.gen if gen else 0,
                            joining=bool(gen and self.rank in gen.joining),
                            # A lost peer is refilled live (elastic or not) where survivors
                            # keep their work; planned resizes need an elastic range.
                            live_resize=(spec.survivors_keep_work or spec.live_resize and rng.elastic)
                            and self.store is not None,
                            group_store=self._group_store, telemetry=self.telemetry,
                            gpu_type=hw.get("gpu_type"), emulated_speed=speed)

    def _checkpoint_event(self, event: dict[str, Any]) -> None:
        """An upload retried: a log line, and from rank 0 an event (Redis down: no event)."""
        self.sink.emit(event.get("message", ""), level="WARNING", module="checkpoint")
        with contextlib.suppress(Exception):
            self.rank == 0 and self.store is not None and self.store.add_event(self.job_id, event)

    def _record_checkpoint(self, info: Any) -> None:
        """List a committed checkpoint on the job; the files on disk are what counts,
        so a Redis outage only costs the listing, never the training."""
        store = self.store
        assert store is not None
        rec = store.recorder(self.job_id)
        rec.observe(metrics.CHECKPOINT_SAVE, info.write_s or info.blocked_s, job=self.job_id)
        rec.observe(metrics.CHECKPOINT_BLOCKED, info.blocked_s, job=self.job_id)
        rec.inc(metrics.CHECKPOINT_BYTES, float(info.bytes), job=self.job_id)
        try:
            store.add_checkpoint(self.job_id, {**info.to_json(), "committed_at": time.time()})
        except Exception as exc:
            self.sink.emit(f"could not list checkpoint step {info.step} in Redis: {exc}",
                           level="WARNING", module="worker")

    def reset(self) -> None:
        """Leave the process group after a peer failed, keeping the process warm (the
        in-place recovery path calls this on survivors, then `join` and `run` again)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self._group_store = None
        if self.heartbeat is not None:
            self.heartbeat.set_phase("init")

    def shutdown(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if getattr(self, "telemetry", None) is not None:
            if self.store is not None:
                telemetry.unregister(self.store, self.telemetry)
            self.telemetry.close()
        if self.holder is not None:
            self.holder.stop()
        self.sink.close()
        if dist.is_initialized():
            dist.destroy_process_group()


class SpareWorker(TrainWorker):
    """A warm process on a node of a job, waiting to take over a failed rank there.

    Its actor (rank_actor.py's `SpareActor`) has already imported torch and the
    trainer, which is most of what a new rank costs to start, and run one tiny
    training step to pay the first-call costs after them, at background priority
    (warm_up.py). It holds no Ray resources of its own: when it adopts
    a rank it uses the GPUs the job's placement group still reserves for that
    rank's bundle, so the cluster's accounting stays whole.
    """

    def __init__(self) -> None:  # noqa: D107 -- the rank comes later, with `adopt`
        self.gpu_ids: list[int] = []

    def adopt(self, job_id: str, rank: int, world_size: int, settings: Settings,
              gpu_ids: list[int], node: str, heartbeat: tuple[float, float] | None,
              grant: dict[str, Any] | None = None, authority: Any = None,
              hardware: dict[str, Any] | None = None) -> int:
        """Become `rank` of the job, on the failed rank's GPUs; returns this pid."""
        TrainWorker.__init__(self, job_id, rank, world_size, settings, None, node, heartbeat,
                             grant, authority, hardware)
        self.gpu_ids = list(gpu_ids)
        if self.holder is not None:
            # The failed rank's GPUs: planned ones (its token names them), or, on a
            # node without per-GPU resources, Ray's pick (its token names none).
            scoped = bool(self.holder.claims.scope.devices)
            self._check_devices(self.gpu_ids, planned=scoped or not self.gpu_ids)
        if self.gpu_ids:  # before CUDA initialises
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpu_ids))
        return os.getpid()

    def describe(self) -> dict[str, Any]:
        return self._where(self.gpu_ids, self.gpu_ids)

