"""The suite's run order (tests/conftest.py) rests on one mark: a module whose
fixture starts a Ray stack of its own carries `own_stack`, so that it runs before
the shared stack comes up. These checks read the test sources; nothing runs."""

from __future__ import annotations

import ast
from pathlib import Path

LIVE = [Path(__file__).resolve().parents[1] / d for d in ("integration", "security")]
# What a fixture that brings a stack up calls: `kc up`, or a Ray head by hand.
# `small_stack(` is tests/integration/conftest.py's `kc up` for a module's own stack;
# `Cluster(` is `ray.cluster_utils.Cluster`, a Ray cluster of the module's own (its
# driver connects and disconnects: beside the shared stack's it would cut that one).
STARTS_A_STACK = ('kc("up"', '"start", "--head"', "small_stack(", "Cluster(")


def _is_fixture(node: ast.FunctionDef) -> bool:
    return any("fixture" in ast.unparse(d) for d in node.decorator_list)


def _marked_own_stack(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
               and "own_stack" in ast.unparse(n.value) for n in tree.body)


def _modules() -> dict[str, tuple[ast.Module, str]]:
    return {p.name: (ast.parse(text := p.read_text()), text)
            for folder in LIVE for p in sorted(folder.glob("test_*.py"))}


def _starts_a_stack(tree: ast.Module, text: str) -> bool:
    return any(isinstance(n, ast.FunctionDef) and _is_fixture(n)
               and any(s in ast.get_source_segment(text, n) for s in STARTS_A_STACK) for n in tree.body)


def test_the_modules_marked_own_stack_are_those_whose_fixture_starts_a_stack():
    modules = _modules()
    starting = {name for name, (tree, text) in modules.items() if _starts_a_stack(tree, text)}
    marked = {name for name, (tree, _) in modules.items() if _marked_own_stack(tree)}
    # The elastic and infrastructure-fault modules have stacks of their own; if the
    # search finds none, it no longer recognises how a fixture starts one.
    assert {"test_elastic.py", "test_fault_infra.py"} <= starting
    assert starting - marked == set(), f"mark these modules own_stack (pytestmark): {starting - marked}"
    assert marked - starting == set(), f"these start no stack in a fixture: {marked - starting}"
