"""The session's shared stack, and the run order across the whole suite.

`stack` and `ray_driver` live here so that every folder of live tests
(tests/integration, tests/security) shares one stack; what they do is in
tests/integration/conftest.py.

The session's shared stack is a
4-node Ray cluster with its control plane; idle, it still takes some 10% of a
2-core machine (raylets, dashboard agents, the control-plane actors' loops), and
the modules that start a stack of their own ran a quarter slower beside it
(tests/integration/test_elastic.py: 119 s alone, 156 s with the shared stack
up). So modules run in three tiers: those with a stack of their own first, then
those that need no stack, then those that use the shared one, which comes up
for the last tier and goes down when the session ends. Within a tier, modules
keep pytest's order, and a module's tests stay together and in their order
(module fixtures are set up once; some modules run a test last on purpose),
except the benchmarks' quick runs: they start in the background as the
no-stack tier begins, and their module comes last in that tier
(tests/bench/quick.py).

`--tiers stack|nostack` runs only the tiers with a stack or only the one
without. `make test` runs them as two pytest processes (tests/suite.py): the
tier without a stack starts when the shared-stack tier begins, and runs beside
it at a lower CPU priority.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.suite import SHARED_BEGAN_ENV

OWN_STACK, NO_STACK, SHARED_STACK = 0, 1, 2
BENCH_MODULE = "test_bench_quick.py"
_TIERS: dict[object, int] = {}
_BACKGROUND: list[bool] = []  # the quick runs were started


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    from tests.integration.conftest import shared_stack

    yield from shared_stack(tmp_path_factory)


@pytest.fixture(scope="session")
def ray_driver(stack):
    from tests.integration.conftest import connect_driver

    yield from connect_driver(stack)


def _tier(module: object, items: list[pytest.Item]) -> int:
    own = any(item.get_closest_marker("own_stack") for item in items)
    shared = any("stack" in getattr(item, "fixturenames", ()) for item in items)
    if own and shared:  # run first, it would bring the shared stack up for the whole session
        raise pytest.UsageError(f"{module} is marked own_stack but uses the shared `stack` fixture: "
                                "drop the mark, or move the tests that use `stack` to another module")
    return OWN_STACK if own else SHARED_STACK if shared else NO_STACK


# `--tiers`: which tiers this session runs. `make test` (tests/suite.py) runs the tiers
# that use a Ray stack in one pytest process and the tier without one in another,
# beside it at a lower CPU priority.
TIER_CHOICES = {"all": {OWN_STACK, NO_STACK, SHARED_STACK}, "stack": {OWN_STACK, SHARED_STACK},
                "nostack": {NO_STACK}}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--tiers", choices=sorted(TIER_CHOICES), default="all",
                     help="run only the modules with a Ray stack (own or shared), only those "
                          "without one, or all (the default)")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    by_module: dict[object, list[pytest.Item]] = {}
    for item in items:
        by_module.setdefault(item.path, []).append(item)
    tiers = {module: _tier(module, group) for module, group in by_module.items()}
    keep = TIER_CHOICES[config.getoption("--tiers")]
    if left := [item for item in items if tiers[item.path] not in keep]:
        config.hook.pytest_deselected(items=left)
        items[:] = [item for item in items if tiers[item.path] in keep]
    # The benchmarks' quick runs start in the background when the no-stack tier begins;
    # their module comes last in it and collects them (tests/bench/quick.py).
    items[:] = sorted(items, key=lambda item: (tiers[item.path], item.path.name == BENCH_MODULE))
    _TIERS.update(tiers)



def pytest_runtest_setup(item: pytest.Item) -> None:
    # tests/suite.py's signal: the file it names is created when the shared-stack tier
    # begins, and the tier without a stack then starts beside it.
    if (mark := os.environ.get(SHARED_BEGAN_ENV)) and _TIERS.get(item.path) == SHARED_STACK:
        Path(mark).touch()
    if not _BACKGROUND and _TIERS.get(item.path, NO_STACK) >= NO_STACK \
            and NO_STACK in TIER_CHOICES[item.config.getoption("--tiers")]:
        from tests.bench import quick

        _BACKGROUND.append(True)
        quick.launch(quick.selected_scripts(item.session.items))


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _BACKGROUND:
        from tests.bench import quick

        quick.stop()


@pytest.fixture(scope="session", autouse=True)
def no_network_left_behind():
    """After the suite, no network namespace, link or bridge that a netns cluster of this
    run made may remain. Each stack records its cluster's tag as it comes up; namespaces
    of other tags belong to another run (a benchmark beside the suite, say)."""
    from kuangchao.platform.runtime import netns
    from tests.integration.conftest import NETNS_TAGS

    yield
    if netns.unavailable() is None:
        left = sorted(name for tag in NETNS_TAGS for name in netns.leftovers(tag))
        assert not left, f"the suite left network namespaces or links behind: {left}"
