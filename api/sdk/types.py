"""Typed views of the REST API's JSON, returned by `kuangchao.api.sdk.client.Client`.

Each view is the JSON object itself (a `dict` subclass), so `job["state"]`,
`json.dumps(job)` and code written against the plain JSON keep working, with
typed attributes on top: `job.state`, `job.progress.loss`, `job.placement[0].node`.
An attribute the server did not send reads as None (or empty), never KeyError:
older servers and jobs that never started omit fields.
"""

from __future__ import annotations

from typing import Any, ClassVar

TERMINAL_STATES = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})


class View(dict):
    """A JSON object with typed attributes (see the subclasses)."""

    def _get(self, key: str, default: Any = None) -> Any:
        value = self.get(key)
        return default if value is None else value

    def __repr__(self) -> str:
        shown = {k: self.get(k) for k in self._shown if k in self}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    _shown: ClassVar[tuple[str, ...]] = ()


class Progress(View):
    _shown = ("step", "total_steps", "loss")

    @property
    def step(self) -> int:
        return int(self._get("step", 0))

    @property
    def total_steps(self) -> int | None:
        return self.get("total_steps")

    @property
    def loss(self) -> float | None:
        return self.get("loss")

    @property
    def initial_loss(self) -> float | None:
        return self.get("initial_loss")

    @property
    def tokens_per_s(self) -> float | None:
        return self.get("tokens_per_s")

    @property
    def eval_loss(self) -> float | None:
        """The held-out split's loss at the last evaluation (`training.eval_interval`)."""
        return self.get("eval_loss")


class Placement(View):
    """Where one rank runs."""

    _shown = ("rank", "node", "gpus")

    @property
    def rank(self) -> int:
        return int(self["rank"])

    @property
    def node(self) -> str:
        return str(self["node"])

    @property
    def leaf(self) -> str | None:
        return self.get("leaf")

    @property
    def gpus(self) -> list[int]:
        return list(self._get("gpus", []))

    @property
    def pid(self) -> int | None:
        return self.get("pid")


class Checkpoint(View):
    _shown = ("step", "path")

    @property
    def step(self) -> int:
        return int(self["step"])

    @property
    def path(self) -> str:
        return str(self["path"])


class Goodput(View):
    """Where a job's wall-clock time went: `productive_s` plus `by_cause` is `wall_s`."""

    _shown = ("ettr", "wall_s")

    @property
    def ettr(self) -> float | None:
        """Effective training time ratio: productive seconds over wall-clock seconds."""
        return self.get("ettr")

    @property
    def wall_s(self) -> float | None:
        return self.get("wall_s")

    @property
    def productive_s(self) -> float | None:
        return self.get("productive_s")

    @property
    def by_cause(self) -> dict[str, float | None]:
        """Seconds by cause: startup, checkpoint, detection, recovery, redone, queueing,
        preemption, other."""
        return dict(self._get("by_cause", {}))


class Job(View):
    """A job as `GET /v1/jobs/{id}` returns it."""

    _shown = ("id", "name", "state")

    @property
    def id(self) -> str:
        return str(self["id"])

    @property
    def name(self) -> str:
        return str(self._get("name", ""))

    @property
    def state(self) -> str:
        return str(self["state"])

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def succeeded(self) -> bool:
        return self.state == "SUCCEEDED"

    @property
    def reason(self) -> str | None:
        """Why the job is where it is: for FAILED, the last error (the record's `message`)."""
        return self.get("message")

    @property
    def queue(self) -> str | None:
        return self.get("queue")

    @property
    def tenant(self) -> str | None:
        return self.get("tenant")

    @property
    def owner(self) -> str | None:
        return self.get("owner")

    @property
    def world_size(self) -> int | None:
        return self.get("world_size")

    @property
    def progress(self) -> Progress:
        return Progress(self._get("progress", {}))

    @property
    def placement(self) -> list[Placement]:
        return [Placement(p) for p in self._get("placement", [])]

    @property
    def checkpoints(self) -> list[Checkpoint]:
        return [Checkpoint(c) for c in self._get("checkpoints", [])]

    @property
    def plan(self) -> dict[str, Any] | None:
        return self.get("plan")

    @property
    def spec(self) -> dict[str, Any]:
        return dict(self._get("spec", {}))

    @property
    def goodput(self) -> Goodput | None:
        """Where its time went; only on one job's view (`Client.get`), not on a listing."""
        found = self.get("goodput")
        return None if found is None else Goodput(found)


class Event(View):
    """One entry of a job's timeline: `type` is state, placement, failure, resize, ..."""

    _shown = ("type", "message")

    @property
    def ts(self) -> float:
        return float(self._get("ts", 0.0))

    @property
    def type(self) -> str:
        return str(self._get("type", ""))

    @property
    def message(self) -> str:
        return str(self._get("message", "") or self._get("reason", ""))


class LogLine(View):
    _shown = ("rank", "level", "message")

    @property
    def ts(self) -> float:
        return float(self._get("ts", 0.0))

    @property
    def level(self) -> str:
        return str(self._get("level", "INFO"))

    @property
    def rank(self) -> int | None:
        return self.get("rank")

    @property
    def module(self) -> str | None:
        return self.get("module")

    @property
    def message(self) -> str:
        return str(self._get("message", ""))


class MetricPoint(View):
    """One logged step of the loss curve."""

    _shown = ("step", "loss")

    @property
    def step(self) -> int:
        return int(self["step"])

    @property
    def ts(self) -> float:
        return float(self._get("ts", 0.0))

    @property
    def loss(self) -> float | None:
        return self.get("loss")

    @property
    def tokens_per_s(self) -> float | None:
        return self.get("tokens_per_s")


class Page(View):
    """A page of a job's events, logs or metrics: the entries, and `next`, the
    cursor the following call starts at (`start=page.next`)."""

    entry_key: ClassVar[str] = ""
    entry_type: ClassVar[type[View]] = View

    @property
    def entries(self) -> list:
        return [self.entry_type(e) for e in self._get(self.entry_key, [])]

    @property
    def next(self) -> int:
        return int(self._get("next", 0))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.get(self.entry_key) or [])} entries, next={self.next})"


class EventPage(Page):
    entry_key, entry_type = "events", Event


class LogPage(Page):
    entry_key, entry_type = "logs", LogLine


class MetricsPage(Page):
    entry_key, entry_type = "points", MetricPoint
