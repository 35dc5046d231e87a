"""Guards on the code's shape: layers as folders, layering, and no shadowing of the stdlib."""

import ast
import re
import tomllib
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE_ROOTS = ("platform", "workers", "api")
# Decisions without side effects: they take no Ray, Redis or torch import, not even
# through the kuangchao modules they import at load time.
PURE = [
    "platform/errors.py",
    "platform/spec/jobspec.py", "platform/spec/elastic.py",
    "platform/cluster/topology.py", "platform/cluster/hardware.py",
    "platform/placement/solver.py", "platform/placement/score.py",
    "platform/scheduling/policies.py", *(f"platform/scheduling/plugins/{m}.py" for m in (
        "admission", "backfill", "cycle", "decisions", "elastic", "fifo", "gang", "interface",
        "preemption", "quota", "registry", "snapshot")),
    "platform/spec/stored.py", "platform/scheduling/scheduler.py",
    "platform/spec/queues.py",
    "platform/planning/planner.py", "platform/planning/autoplan.py",
    "platform/planning/experts.py", "platform/observability/routing.py",
    "platform/planning/activations.py",
    "platform/jobs/state.py", "platform/jobs/debugreq.py",
    "platform/jobs/memory.py", "platform/jobs/memory_more.py", "platform/jobs/encoding.py",
    "platform/jobs/record_edits.py", "platform/jobs/memory_security.py",
    "platform/security/tokens.py", "platform/security/apikeys.py",
    "platform/jobs/redis_acl.py", "platform/security/audit.py",
    "platform/observability/metrics.py", "platform/observability/scrape_targets.py",
    "platform/observability/logjson.py", "platform/observability/goodput.py",
    "platform/jobs/goodput_facts.py",
    "platform/execution/failure_policy.py", "platform/jobs/claims.py",
    "platform/execution/members.py", "platform/cluster/netplan.py", "platform/cluster/leaves.py",
    "platform/cluster/drain.py", "platform/execution/drain_policy.py",
    "platform/protocol/memory_copies.py", "platform/protocol/node_columns.py",
    "platform/execution/heartbeat.py", "platform/execution/beat_table.py",
    "platform/execution/relayed.py",
    "platform/jobs/redis_sizing.py", "platform/runtime/doctor_capacity.py",
]
# Modules that may reach Redis but never Ray: the controller reaches Ray only through its
# worker group, loaded when none is given. (The scheduler takes its store injected and is pure.)
RAY_FREE = [*PURE, "platform/execution/controller.py", "platform/execution/formation.py",
            "platform/execution/detection.py", "platform/execution/inplace.py",
            "platform/execution/resize.py", "platform/execution/drain.py",
            "platform/execution/memory_plan.py"]
SERVICES = ("ray", "redis", "torch")
MAX_TOP_LEVEL_MODULES = 8


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imports(path: Path, load_time_only: bool = False) -> set[str]:
    """The modules `path` imports; with `load_time_only`, only those its import runs
    (not inside functions, not under `if TYPE_CHECKING`)."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if load_time_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if load_time_only and isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                out.add(child.module)
                out.update(f"{child.module}.{a.name}" for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    return out


def module_file(module: str) -> Path | None:
    """The file that `module` loads from (a root folder for the namespace portions)."""
    parts = module.split(".")
    if parts[0] != "kuangchao" or len(parts) < 2:
        return None
    base = ROOT.joinpath(*parts[1:])
    if len(parts) == 2 and base.is_dir():
        return base
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@cache
def load_time_closure(path: Path) -> frozenset[str]:
    """Every module importing `path` loads, following kuangchao's own modules."""
    seen: set[str] = set()
    todo = [path]
    done: set[Path] = set()
    while todo:
        current = todo.pop()
        if current in done:
            continue
        done.add(current)
        for module in imports(current, load_time_only=True):
            seen.add(module)
            target = module_file(module)
            if target is not None and target.is_file():
                todo.append(target)
                # a package's __init__ runs before any of its modules
                for parent in target.relative_to(ROOT).parents:
                    init = ROOT / parent / "__init__.py"
                    if init.is_file():
                        todo.append(init)
    return frozenset(seen)


def code_files():
    for root in CODE_ROOTS:
        yield from (ROOT / root).rglob("*.py")


def test_code_folders_have_no_init_file():
    for folder in CODE_ROOTS:
        assert not (ROOT / folder / "__init__.py").exists(), folder


def test_every_layer_folder_is_a_regular_package():
    for root in CODE_ROOTS:
        for folder in (ROOT / root).rglob("*"):
            if folder.is_dir() and any(folder.glob("*.py")):
                assert (folder / "__init__.py").is_file(), f"{folder.relative_to(ROOT)} has no __init__.py"


def test_pyproject_lists_every_package_so_pip_install_ships_them_all():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {f"kuangchao.{root}" for root in CODE_ROOTS}
    for root in CODE_ROOTS:
        for init in (ROOT / root).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / root)
            found.add(".".join(("kuangchao", root, *rel.parts)))
    assert listed == found, f"missing {sorted(found - listed)}, stale {sorted(listed - found)}"


def test_platform_and_workers_keep_at_most_eight_top_level_modules():
    for root in ("platform", "workers"):
        top = sorted(p.name for p in (ROOT / root).glob("*.py"))
        assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{root}/: {top}; move them into a layer folder"


def test_architecture_doc_names_every_layer_folder():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    for root in CODE_ROOTS:
        for init in (ROOT / root).rglob("__init__.py"):
            folder = init.parent.relative_to(ROOT).as_posix() + "/"
            assert re.search(rf"`{re.escape(folder)}`", doc), f"docs/architecture.md has no line for {folder}"


def test_pure_modules_load_no_ray_redis_or_torch():
    for rel in PURE:
        loaded = load_time_closure(ROOT / rel)
        bad = {m for m in loaded if m.split(".")[0] in SERVICES}
        assert not bad, f"{rel} loads {sorted(bad)}"


def test_ray_free_modules_never_import_ray():
    for rel in RAY_FREE:
        bad = {m for m in load_time_closure(ROOT / rel) if m.split(".")[0] == "ray"}
        assert not bad, f"{rel} loads {sorted(bad)}"


def test_workers_never_import_api():
    for path in (ROOT / "workers").rglob("*.py"):
        bad = {m for m in imports(path) if m.startswith("kuangchao.api")}
        assert not bad, f"{path} imports {bad}"


def test_platform_never_imports_api():
    for path in (ROOT / "platform").rglob("*.py"):
        bad = {m for m in imports(path) if m.startswith("kuangchao.api")}
        assert not bad, f"{path} imports {bad}"


def test_imported_kuangchao_modules_exist():
    for path in code_files():
        for module in imports(path):
            if module.startswith("kuangchao.") and module_file(module) is None:
                # `from pkg import name`: the name is an attribute, its module the parent
                parent = module.rpartition(".")[0]
                assert module_file(parent) is not None, f"{path.relative_to(ROOT)} imports {module}"


# The job record and its state machine are the control plane's: ranks report, the
# controller applies (platform/execution/reports.py).
RECORD_WRITES = {"update", "annotate_restart", "annotate_resize", "close_resize", "record_failure",
                 "requeue_for_recovery", "transition"}
STATE_OPERATIONS = {"transition", "admit", "start", "resume_after_rollback", "recover", "resize",
                    "settle_resize", "requeue", "finish", "fail", "cancel"}


def _calls(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return names


def _receivers(path: Path, method: str) -> set[str]:
    """The dotted names `x.y` of every `x.y.method(...)` call in `path`."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method:
            out.add(ast.unparse(node.func.value))
    return out


def test_workers_never_write_the_job_record_or_its_state():
    for path in (ROOT / "workers").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in (
                    "kuangchao.platform.jobs.state", "kuangchao.platform.execution.recovery"):
                bad = {a.name for a in node.names} & (STATE_OPERATIONS | RECORD_WRITES)
                assert not bad, f"{path.relative_to(ROOT)} imports {bad}; post a report instead"
        store_writes = {n for n in _calls(path) if n in RECORD_WRITES - {"update"}}
        store_writes |= {f"{r}.update" for r in _receivers(path, "update") if r.endswith("store")}
        assert not store_writes, f"{path.relative_to(ROOT)} calls {store_writes}; post a report instead"


def test_only_the_state_module_calls_transition():
    for path in code_files():
        if path == ROOT / "platform" / "jobs" / "state.py":
            continue
        assert "transition" not in _calls(path), (
            f"{path.relative_to(ROOT)} calls transition(); use a named operation of platform/jobs/state.py")


# What a test may not import to live in tests/unit, the pure tier: no processes,
# no sockets, no Redis, no Ray. (test_data names the host in an expected message:
# `socket.gethostname` opens nothing.)
UNPURE_TEST_IMPORTS = ("subprocess", "multiprocessing", "torch.multiprocessing", "redis", "ray",
                       "kuangchao.platform.runtime.procs")


def test_unit_tests_start_no_process_and_reach_no_service():
    for path in sorted((ROOT / "tests" / "unit").glob("test_*.py")):
        bad = {m for m in imports(path) if m.startswith(UNPURE_TEST_IMPORTS)}
        assert not bad, (f"{path.relative_to(ROOT)} imports {sorted(bad)}: move the test to "
                         "tests/process, tests/layouts or tests/integration")


def test_redis_key_names_are_built_only_in_the_keys_module():
    # `{prefix}job:`, `{p}auth:` ...: a key spelled out anywhere else drifts from the table.
    spelled = re.compile(r"\{(?:prefix|p|self\.p|store\.p)\}"
                         r"(?:job|jobs|auth|info|sched|node|quarantine|metrics)\b")
    for path in code_files():
        if path == ROOT / "platform" / "jobs" / "keys.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                text = ast.unparse(node)
                assert not spelled.search(text), (
                    f"{path.relative_to(ROOT)} spells a Redis key ({text}); add it to platform/jobs/keys.py")


def test_scheduling_and_spec_modules_import_each_other_without_a_cycle():
    """Deferred imports included: a cycle hidden in a function is still a cycle."""
    files = [*(ROOT / "platform" / "scheduling").rglob("*.py"), ROOT / "platform/spec/stored.py"]
    graph = {f: {t for m in imports(f) if (t := module_file(m)) in files and t != f} for f in files}
    done: set[Path] = set()

    def visit(f: Path, path: tuple[Path, ...]) -> None:
        assert f not in path, " -> ".join(p.relative_to(ROOT).as_posix() for p in (*path, f))
        if f not in done:
            for t in graph[f]:
                visit(t, (*path, f))
            done.add(f)

    for f in files:
        visit(f, ())


# -- the wire formats ---------------------------------------------------------------

PROTOCOL = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "platform" / "protocol").glob("*.py"))


def test_the_protocol_package_loads_no_torch_ray_or_redis():
    # The controller, the API and the CLI read these formats without a training stack.
    assert PROTOCOL, "platform/protocol/ has no modules"
    for rel in PROTOCOL:
        loaded = load_time_closure(ROOT / rel)
        bad = {m for m in loaded if m.split(".")[0] in SERVICES}
        assert not bad, f"{rel} loads {sorted(bad)}"
        # Not even a lazy import inside a function: no reader may need one.
        lazy = {m for m in imports(ROOT / rel) if m.split(".")[0] in SERVICES}
        assert not lazy, f"{rel} imports {sorted(lazy)}"


# -- no import cycle between subpackages ----------------------------------------------
#
# One node per folder (kuangchao.platform.execution, kuangchao.workers.runtime, ...).
# The modules at the top of platform/, workers/ and api/ (errors.py, settings.py,
# collectives.py ...) are each a node of their own: those folders are namespace
# portions holding layers, not a layer, and errors.py (imported by every layer)
# has nothing to do with settings.py beside it.
#
# Every import counts, also those inside functions: a lazy import is still a
# dependency, and a cycle through one only moves the failure to run time. What
# does not count is `if TYPE_CHECKING:`: it never runs, and it is the standard
# way to name a type for an annotation without depending on its module.
#


def _subpackage_of_file(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if len(parts) == 2:  # a top-level module of a namespace portion: its own node
        return ".".join(("kuangchao", *parts))
    return ".".join(("kuangchao", *parts[:-1]))


def _subpackage_of_module(module: str) -> str | None:
    target = module_file(module)
    if target is None:  # `from pkg.mod import name`: the name's module is the parent
        target = module_file(module.rpartition(".")[0])
    if target is None or target.is_dir():
        return None
    return _subpackage_of_file(target)


def _imports_with_lines(path: Path):
    """(line, module) of every import that runs sometime: all but `if TYPE_CHECKING:`."""
    def visit(node: ast.AST):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if isinstance(child, ast.Import):
                yield from ((child.lineno, a.name) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                yield child.lineno, child.module
                yield from ((child.lineno, f"{child.module}.{a.name}") for a in child.names)
            yield from visit(child)

    yield from visit(ast.parse(path.read_text()))


@cache
def subpackage_graph() -> dict[tuple[str, str], tuple[str, ...]]:
    """(importer, imported) subpackage -> where: "file:line module" of each import behind it."""
    edges: dict[tuple[str, str], set[str]] = {}
    for path in code_files():
        src = _subpackage_of_file(path)
        for line, module in _imports_with_lines(path):
            dst = _subpackage_of_module(module) if module.startswith("kuangchao.") else None
            if dst is not None and dst != src:
                edges.setdefault((src, dst), set()).add(f"{path.relative_to(ROOT)}:{line} {module}")
    return {edge: tuple(sorted(where)) for edge, where in edges.items()}


def find_cycle(edges) -> list[str] | None:
    """One cycle of the directed graph `edges` ((a, b) pairs) as [a, b, ..., a], or None."""
    succ: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        succ.setdefault(a, []).append(b)
    state: dict[str, int] = {}  # 1: on the current path, 2: done, no cycle through it
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in succ.get(node, ()):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := dfs(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(succ):
        if start not in state and (found := dfs(start)):
            return found
    return None


def test_find_cycle_finds_one_and_only_one_that_exists():
    assert find_cycle({("a", "b"), ("b", "c")}) is None
    assert find_cycle({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) == ["a", "b", "c", "a"]


def test_subpackages_import_each_other_without_a_cycle():
    graph = subpackage_graph()
    cycle = find_cycle(set(graph))
    if cycle:
        hops = [f"  {a} -> {b}: {', '.join(graph[a, b][:3])}" for a, b in zip(cycle, cycle[1:], strict=False)]
        raise AssertionError("subpackages import each other in a cycle; move the code to the "
                             "layer it belongs to:\n" + "\n".join(hops))


def test_workers_never_import_the_execution_layer():
    # The controller may import the worker actor's class; the other way round is a cycle.
    for (src, dst), where in subpackage_graph().items():
        if src.startswith("kuangchao.workers") and dst == "kuangchao.platform.execution":
            raise AssertionError(f"{src} imports the execution layer: {where}")


# -- module size ------------------------------------------------------------------------

MAX_MODULE_LINES = 400
# Being split by others right now; empty this once they are.
def test_no_module_under_platform_or_workers_exceeds_400_lines():
    # A module past a few hundred lines holds more than one idea: split it along a seam.
    too_long = {}
    for root in ("platform", "workers"):
        for path in (ROOT / root).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            lines = len(path.read_text().splitlines())
            if lines > MAX_MODULE_LINES:
                too_long[rel] = lines
    assert not too_long, f"over {MAX_MODULE_LINES} lines: {too_long}; split them along a seam"


def test_the_controller_module_stays_a_composition_of_its_collaborators():
    # Its decisions live in the failure policy and the executors; past 300 lines it is
    # growing logic of its own again.
    lines = len((ROOT / "platform/execution/controller.py").read_text().splitlines())
    assert lines <= 300, f"platform/execution/controller.py has {lines} lines"


def test_the_controller_loads_no_ray_or_torch_so_its_unit_tests_need_neither():
    # Ray comes with the default worker group, torch only in the ranks; the
    # controller reads generations and manifests through platform/protocol.
    loaded = load_time_closure(ROOT / "platform/execution/controller.py")
    assert not {m for m in loaded if m.split(".")[0] in ("ray", "torch")}, sorted(
        m for m in loaded if m.split(".")[0] in ("ray", "torch"))


def test_the_worker_group_loads_no_torch_until_its_ranks_start():
    # A new controller imports the group on every job's path to its first step:
    # torch and the trainer there cost seconds the ranks spend starting anyway.
    for path in ("platform/execution/group.py", "platform/execution/spares.py",
                 "workers/runtime/rank_actor.py"):
        loaded = load_time_closure(ROOT / path)
        heavy = sorted(m for m in loaded
                       if m.split(".")[0] == "torch" or m == "kuangchao.workers.runtime.worker")
        assert not heavy, f"{path} loads {heavy}"


def test_a_rank_unpickling_the_authority_handle_loads_no_control_plane():
    # Ray imports an actor's class module where its handle is unpickled: in every
    # rank, for the token authority's. The controller and the scheduler (and the
    # torch they load) must not come with it.
    loaded = load_time_closure(ROOT / "platform/runtime/authority_actor.py")
    control = sorted(m for m in loaded if m.startswith(("kuangchao.platform.execution",
                                                        "kuangchao.platform.scheduling"))
                     or m in ("kuangchao.platform.runtime.actors", "torch"))
    assert not control, f"authority_actor.py loads {control}"


# No raw Redis client outside the store: platform/jobs holds every Redis operation
# (the `r` attribute of `JobStore` is its client). Each exception says why.
RAW_CLIENT_EXCEPTIONS = {
    # A rank's heartbeat thread keeps a client of its own with tight timeouts (the
    # store's retries for seconds); its writes are the store's own pipeline writes.
    "workers/runtime/beat_client.py": "the heartbeat thread's and node agent's own client",
    "workers/runtime/debug.py": "answers on the heartbeat thread's client",
    # `kc doctor` probes a URL it is given, before any store exists.
    "platform/runtime/doctor_probe.py": "probes a URL",
}


def _raw_client_uses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "r":
            found.append(f"{ast.unparse(node)} (line {node.lineno})")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "from_url" and ast.unparse(node.func.value).endswith("Redis")):
            found.append(f"{ast.unparse(node.func)} (line {node.lineno})")
    return found


def test_no_raw_redis_client_outside_the_store():
    for path in code_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("platform/jobs/") or rel in RAW_CLIENT_EXCEPTIONS:
            continue
        found = _raw_client_uses(path)
        assert not found, f"{rel} uses a Redis client directly: {found}; add a store method"


def test_every_raw_client_exception_is_still_needed():
    for rel in RAW_CLIENT_EXCEPTIONS:
        text = (ROOT / rel).read_text()
        assert _raw_client_uses(ROOT / rel) or "client" in text, f"{rel} no longer needs its exception"
