"""Every exception class pickles and unpickles: they cross Ray actor boundaries.

The classes are found by importing every module of the three code folders, so a
new exception is covered the day it is written; a class whose constructor needs
more than a message gets an example below."""

import importlib
import inspect
import pickle
from pathlib import Path

import pytest

from kuangchao.platform.execution.recovery import Failure

ROOT = Path(__file__).resolve().parents[2]
# Private control-flow exceptions may stay beside the code that raises and catches them.
PRIVATE_PREFIX = "_"

EXAMPLES = {
    "SpecError": lambda cls: cls([("parallel.tp", "must divide n_heads"), ("", "second problem")]),
    "WorkerLost": lambda cls: cls(Failure("died", "rank 3 died (SIGKILL)", rank=3, node="n1", pid=42)),
    "TokenError": lambda cls: cls("denied", "all_to_all is not in the token's interfaces"),
    "CopyRefused": lambda cls: cls("too_large", "rank 3's copy of step 12 is 80 MB, over 64"),
    "NumericFault": lambda cls: cls(11, 12, "loss is nan"),
    "ResizeNow": lambda cls: cls(4),
    "ApiError": lambda cls: cls(422, [{"loc": ["body", "parallel", "tp"], "msg": "must divide n_heads"}]),
    "FinishedDuringResize": lambda cls: cls(),
    "_NoFit": lambda cls: cls(),
}


def _modules():
    for root in ("platform", "workers", "api"):
        for path in sorted((ROOT / root).rglob("*.py")):
            if path.name == "__main__.py":
                continue
            name = ".".join(("kuangchao", *path.relative_to(ROOT).with_suffix("").parts))
            yield name.removesuffix(".__init__")


def _exception_classes():
    found = {}
    for name in _modules():
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if inspect.isclass(cls) and issubclass(cls, BaseException) and cls.__module__ == name:
                found[f"{name}.{cls.__qualname__}"] = cls
    return found


CLASSES = _exception_classes()


def _example(cls):
    build = EXAMPLES.get(cls.__name__)
    return build(cls) if build else cls(f"{cls.__name__}: what went wrong, and the setting to change")


def test_the_search_finds_the_exceptions_of_every_package():
    assert {"kuangchao.platform.errors.WorkerLost", "kuangchao.workers.errors.NumericFault",
            "kuangchao.api.sdk.errors.ApiError"} <= set(CLASSES)


@pytest.mark.parametrize("qualname", sorted(CLASSES))
def test_exception_round_trips_through_pickle(qualname):
    original = _example(CLASSES[qualname])
    copy = pickle.loads(pickle.dumps(original))
    assert type(copy) is type(original)
    assert str(copy) == str(original)
    assert copy.args == original.args
    assert vars(copy) == vars(original)


@pytest.mark.parametrize("qualname", sorted(CLASSES))
def test_exception_lives_in_its_packages_errors_module(qualname):
    module, _, name = qualname.rpartition(".")
    assert name.startswith(PRIVATE_PREFIX) or module.endswith(".errors"), (
        f"{qualname}: move it to the errors module of its package (platform/errors.py, "
        "workers/errors.py, api/sdk/errors.py)")


def test_token_error_reads_reason_then_message_as_permission_errors_do():
    err = EXAMPLES["TokenError"](CLASSES["kuangchao.platform.errors.TokenError"])
    assert isinstance(err, PermissionError) and err.errno is None
    assert str(err) == "denied: all_to_all is not in the token's interfaces"
    assert str(pickle.loads(pickle.dumps(err))) == str(err)


def test_worker_lost_keeps_its_failure_across_pickling():
    lost = EXAMPLES["WorkerLost"](CLASSES["kuangchao.platform.errors.WorkerLost"])
    copy = pickle.loads(pickle.dumps(lost))
    assert copy.failure == lost.failure and copy.message == "rank 3 died (SIGKILL)"
