"""The job spec: what a user writes in a job YAML.

Pydantic validates at the boundary; cross-field rules that name two fields
(`parallel.tensor_parallel_size` against `model.n_heads`) run after the field
checks so that every problem is reported with its own path. `extends:` and
`--set` overrides are resolved here, before validation.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kuangchao.platform.errors import SpecError
from kuangchao.platform.spec.checkpoint import CheckpointSection
from kuangchao.platform.spec.data import DataSection, data_errors
from kuangchao.platform.spec.elastic import ElasticRange, range_errors, range_from
from kuangchao.platform.spec.model import BUILTIN_MODELS, IMPORT_REF, ModelSection, model_errors
from kuangchao.platform.spec.moe import moe_errors
from kuangchao.platform.spec.parallel import (
    DEFAULT_COLLECTIVES,
    ParallelSection,
    expand_auto,
    parallel_errors,
    trainer_collectives,
)
from kuangchao.platform.spec.resources import ResourcesSection

PRIORITY_NAMES = {"high": 100, "normal": 50, "low": 10}
_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"


class _Section(BaseModel):
    # Typos in a spec must fail loudly rather than be silently ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)


class TaskSection(_Section):
    name: str = Field("job", pattern=_NAME)
    priority: int | Literal["high", "normal", "low"] = "normal"
    queue: str = Field("default", pattern=_NAME)

    @property
    def priority_value(self) -> int:
        return PRIORITY_NAMES[self.priority] if isinstance(self.priority, str) else self.priority


class OptimizerSection(_Section):
    type: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(1e-3, gt=0, le=10)
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    momentum: float = Field(0.9, ge=0, lt=1)
    warmup_steps: int = Field(10, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    grad_clip: float | None = Field(1.0, gt=0)


class TrainingSection(_Section):
    steps: int = Field(100, ge=1)
    seed: int = Field(0, ge=0)
    log_interval: int = Field(10, ge=1)
    torch_threads: int = Field(1, ge=1, le=256)
    # Run the model through torch.compile; falls back to eager with a warning where it fails.
    compile: bool = False
    # Every this many steps, the loss on the held-out split (`data.eval_fraction`).
    eval_interval: int | None = Field(None, ge=1)
    # Micro-batches per rank each evaluation averages over.
    eval_batches: int = Field(4, ge=1, le=10_000)


class FaultToleranceSection(_Section):
    max_restarts: int = Field(3, ge=0)
    heartbeat_interval_s: float = Field(1.0, gt=0, le=60)
    heartbeat_timeout_s: float = Field(10.0, gt=0, le=600)
    hang_timeout_s: float = Field(300.0, gt=0)
    # A rank silent this long while every other rank waits on it is failed (off: null).
    peer_wait_timeout_s: float | None = Field(None, gt=0, le=600)
    # A step whose gradient norm exceeds this many times the running median is rolled back.
    grad_norm_spike_factor: float = Field(10.0, gt=1)
    grad_norm_window: int = Field(20, ge=3, le=10_000)
    # Seconds survivors get to stop on their own before they are killed.
    stop_grace_s: float = Field(10.0, ge=0, le=600)
    # Keep one warm process per node of the job, to take over a failed rank at once.
    spare_workers: bool = False
    # With spare_workers, also keep one on this many nodes the job does not use, for a
    # replica moved off a lost or draining node (jobs whose survivors keep their work).
    standby_spares: int = Field(0, ge=0, le=8)
    # One agent per node relays the node's heartbeats in one Redis record
    # (docs/fault-tolerance.md): `auto` starts them for jobs of 64 ranks or more.
    node_agents: Literal["auto", "on", "off"] = "auto"
    # Fault drills: batches (by global data index) whose loss is made NaN.
    inject_nan_at_batches: list[int] = Field(default_factory=list, max_length=100)
    # A drill for `kc debug gradient`: these parameters (by name) are left out of the
    # gradient all-reduce, so the replicas' copies silently drift apart.
    inject_unsynced_params: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(
        default_factory=list, max_length=100)


class ElasticSection(_Section):
    """The data-parallel range; one replica is tensor_parallel_size x pipeline_parallel_size ranks.

    The global batch stays the one `parallel` describes; see platform/spec/elastic.py.
    """

    min_replicas: int | None = Field(None, ge=1)
    max_replicas: int | None = Field(None, ge=1)
    # live: survivors keep their processes and in-memory state and re-form the group;
    # restart: checkpoint, requeue and start again at the new size (any entrypoint).
    # auto: live for the built-in trainer, restart for custom entrypoints.
    resize: Literal["auto", "live", "restart"] = "auto"


class PermissionSection(_Section):
    # The collectives the job's capability tokens whitelist; any other is denied.
    # `allowed_interfaces` (the design documents' name) is read as this field.
    collectives: list[str] = Field(
        default_factory=lambda: list(DEFAULT_COLLECTIVES)
    )
    # Tokens are renewed at 80% of this, so a stolen one is good for at most this long.
    token_ttl_seconds: int = Field(3600, ge=60, le=7 * 86400)
    # A file that also gets this job's audit records; it must lie under the operator's
    # audit root (KC_AUDIT_ROOT), which admission checks.
    audit_log: str | None = Field(None, min_length=1, max_length=4096)

    @model_validator(mode="before")
    @classmethod
    def _alias(cls, data: Any) -> Any:
        if isinstance(data, dict) and "allowed_interfaces" in data:
            if "collectives" in data:
                raise ValueError("allowed_interfaces is another name for collectives; give one")
            data = {**data, "collectives": data["allowed_interfaces"]}
            del data["allowed_interfaces"]
        return data

    @field_validator("collectives")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        from kuangchao.platform.protocol.interfaces import COLLECTIVES

        unknown = sorted(set(v) - COLLECTIVES)
        if unknown:
            raise ValueError(f"{', '.join(unknown)} not a collective; choose from "
                             f"{', '.join(sorted(COLLECTIVES))}")
        return sorted(set(v))


class JobSpec(_Section):
    """A validated job. `model_dump(mode="json")` round-trips through YAML."""

    task: TaskSection = TaskSection()
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    parallel: ParallelSection = ParallelSection()
    resources: ResourcesSection = ResourcesSection()
    optimizer: OptimizerSection = OptimizerSection()
    training: TrainingSection = TrainingSection()
    checkpoint: CheckpointSection = CheckpointSection()
    fault_tolerance: FaultToleranceSection = FaultToleranceSection()
    elastic: ElasticSection = ElasticSection()
    permission: PermissionSection = PermissionSection()
    entrypoint: str | None = None
    args: dict[str, Any] = Field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def gpus_required(self) -> int:
        return self.world_size * self.parallel.gpus_per_rank

    @property
    def elastic_range(self) -> ElasticRange:
        return range_from(lambda name: getattr(self.parallel, name),
                          lambda name: getattr(self.elastic, name))

    @property
    def live_resize(self) -> bool:
        """Whether resizes keep the processes (the built-in trainer, or a declared live entrypoint)."""
        mode = self.elastic.resize
        return mode == "live" or (mode == "auto" and self.entrypoint is None
                                  and not self.parallel.hybrid)

    @property
    def survivors_keep_work(self) -> bool:
        """Whether a failed replica is refilled live, at the same size, while the others keep
        their processes and state (elastic or not): a live-resizing train function with plain
        data parallelism. Otherwise a failure restores every rank from the newest checkpoint."""
        return self.live_resize and not self.parallel.hybrid

    def spec_hash(self) -> str:
        """Stable hash of the full spec, recorded in checkpoint manifests."""
        canon = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]


def _cross_field_errors(spec: JobSpec) -> list[tuple[str, str]]:
    """Rules that relate two fields; each error names the field to change."""
    errs: list[tuple[str, str]] = []
    m, p = spec.model, spec.parallel
    errs.extend(model_errors(m))
    # A Hugging Face model's layers and heads are in its folder: checked at submission.
    shape = (None, None) if m.is_hf else (m.n_layers, m.n_heads)
    errs.extend(parallel_errors(p, *shape, builtin_trainer=spec.entrypoint is None,
                                seq_len=m.seq_len, builtin_model=m.is_builtin))
    if spec.entrypoint is not None and not IMPORT_REF.match(spec.entrypoint):
        errs.append(("entrypoint", f"{spec.entrypoint!r} is not of the form 'package.module:function'"))
    errs.extend(range_errors(spec.model_dump(mode="json")))
    errs.extend(moe_errors(spec))
    errs.extend(data_errors(spec))
    if ".." in Path(spec.checkpoint.path).parts:
        errs.append(("checkpoint.path", f"{spec.checkpoint.path!r} contains '..'; give a path "
                                        "without it (absolute, or relative to $KC_HOME)"))
    if spec.entrypoint is None:
        # The built-in trainer's own collectives go through the token guard.
        needed = sorted(trainer_collectives(p) - set(spec.permission.collectives))
        if needed:
            errs.append(("permission.collectives", f"the built-in trainer needs {', '.join(needed)} "
                                                   "for this layout; add them, or run your own entrypoint"))
        custom = not m.is_hf and IMPORT_REF.match(m.type)  # a user factory
        if custom and (p.tensor_parallel_size > 1 or p.pipeline_parallel_size > 1):
            errs.append(("model.type", "tensor and pipeline parallelism cut the built-in models "
                                       f"({', '.join(BUILTIN_MODELS)}) and Hugging Face folders "
                                       "only; a custom model runs with data parallelism and ZeRO"))
        if spec.fault_tolerance.inject_unsynced_params and (
                p.tensor_parallel_size > 1 or p.pipeline_parallel_size > 1 or p.zero_stage >= 2):
            errs.append(("fault_tolerance.inject_unsynced_params", "the drill leaves parameters "
                         "out of DDP's all-reduce; it needs zero_stage 0 or 1 without tensor or "
                         "pipeline parallelism"))
        if spec.elastic.resize == "live" and p.hybrid:
            errs.append(("elastic.resize", "live resizes keep plain data-parallel replicas only; "
                                           "with tensor or pipeline parallelism or ZeRO use "
                                           "resize: restart (or auto)"))
    ft = spec.fault_tolerance
    if ft.heartbeat_timeout_s < 2 * ft.heartbeat_interval_s:
        errs.append((
            "fault_tolerance.heartbeat_timeout_s",
            f"{ft.heartbeat_timeout_s} must be at least twice fault_tolerance.heartbeat_interval_s "
            f"({ft.heartbeat_interval_s}), so that one late beat is not taken for a death",
        ))
    pw = ft.peer_wait_timeout_s
    if pw is not None and not 3 * ft.heartbeat_interval_s <= pw < ft.heartbeat_timeout_s:
        errs.append(("fault_tolerance.peer_wait_timeout_s", f"{pw} must be at least three "
                     f"heartbeat intervals ({3 * ft.heartbeat_interval_s:g}) and below "
                     f"heartbeat_timeout_s ({ft.heartbeat_timeout_s:g}), or null"))
    if ft.standby_spares and not ft.spare_workers:
        errs.append(("fault_tolerance.standby_spares", "standby spares are warm spares kept on "
                     "nodes the job does not use; set fault_tolerance.spare_workers: true as well, "
                     "or standby_spares: 0"))
    if ft.hang_timeout_s <= ft.heartbeat_timeout_s:
        errs.append((
            "fault_tolerance.hang_timeout_s",
            f"{ft.hang_timeout_s} must exceed fault_tolerance.heartbeat_timeout_s "
            f"({ft.heartbeat_timeout_s}); a hang is judged on a live heartbeat",
        ))
    return errs


def pydantic_errors(exc: ValidationError, prefix: str = "") -> list[tuple[str, str]]:
    """One `(field path, message)` per pydantic error, paths optionally prefixed."""
    out = []
    for err in exc.errors():
        path = prefix + ".".join(str(part) for part in err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field; check the spelling against docs/user-guide.md"
        elif err["type"] == "value_error":  # our own validators' words, without pydantic's label
            msg = msg.removeprefix("Value error, ")
        elif "input" in err and not isinstance(err["input"], dict | list):
            msg = f"{msg} (got {err['input']!r})"
        out.append((path, msg))
    return out


def validate_spec(data: Any) -> JobSpec:
    """Validate a parsed spec document.

    Args:
        data: The spec as plain data (dicts, lists, scalars); `extends` must
            already be resolved.

    Returns:
        The validated `JobSpec`.

    Raises:
        SpecError: With one `(field path, message)` per problem.
    """
    if not isinstance(data, dict):
        raise SpecError([("", f"a job spec must be a mapping, got {type(data).__name__}")])
    if "extends" in data:
        raise SpecError([(
            "extends",
            "is resolved from files by the CLI (`kc submit FILE`), or by the console's Submit "
            "page when the files it names are uploaded with the job; send the merged spec instead",
        )])
    data = expand_auto(data)
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(pydantic_errors(exc)) from None
    errs = _cross_field_errors(spec)
    if errs:
        raise SpecError(errs)
    return spec


def deep_merge(base: dict, child: dict) -> dict:
    """Merge `child` over `base`: mappings merge recursively, the child wins."""
    out = copy.deepcopy(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def read_yaml_mapping(path: Path, what: str = "spec file") -> dict:
    """A YAML file that must hold a mapping; `SpecError` saying what is wrong otherwise."""
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SpecError([("", f"{what} {path} does not exist")]) from None
    except yaml.YAMLError as exc:
        raise SpecError([("", f"{path} is not valid YAML: {exc}")]) from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise SpecError([("", f"{path} must hold a mapping at the top level")])
    return doc


def resolve_extends(path: Path, _seen: tuple[Path, ...] = ()) -> dict:
    """Load a spec file, following `extends:` chains (relative to each file)."""
    path = path.resolve()
    if path in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path))
        raise SpecError([("extends", f"cycle in extends chain: {chain}")])
    doc = read_yaml_mapping(path)
    parent = doc.pop("extends", None)
    if parent is None:
        return doc
    if not isinstance(parent, str):
        raise SpecError([("extends", f"must be a file path, got {parent!r}")])
    base = resolve_extends((path.parent / parent), (*_seen, path))
    return deep_merge(base, doc)


def apply_overrides(doc: dict, overrides: list[str]) -> dict:
    """Apply `a.b=c` overrides; values are parsed as YAML scalars."""
    doc = copy.deepcopy(doc)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise SpecError([("--set", f"{item!r} is not of the form section.field=value")])
        parts = key.strip().split(".")
        node = doc
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise SpecError([(key, f"cannot set a field inside {part!r}, which is not a section")])
            node = child
        node[parts[-1]] = _parse_scalar(raw)
    return doc


_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _parse_scalar(raw: str) -> Any:
    """A `--set` value as YAML would read it, plus `1e-4` as a float (YAML 1.1 says string)."""
    if not raw.strip():
        return ""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    if isinstance(value, str) and _FLOAT.match(value.strip()):
        return float(value)
    return value


def load_spec_document(path: str | Path, overrides: list[str] | None = None) -> dict:
    """Read a spec file, resolve `extends`, apply overrides; not yet validated."""
    return apply_overrides(resolve_extends(Path(path)), overrides or [])


def load_spec(path: str | Path, overrides: list[str] | None = None) -> JobSpec:
    """Read and validate a spec file. Raises `SpecError` on any problem."""
    return validate_spec(load_spec_document(path, overrides))
