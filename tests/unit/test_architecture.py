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
    "platform/scheduling/placement.py", "platform/scheduling/placement_score.py",
    "platform/scheduling/policies.py", "platform/scheduling/elastic_policy.py",
    "platform/scheduling/queues.py",
    "platform/planning/planner.py", "platform/planning/autoplan.py",
    "platform/jobs/state.py", "platform/jobs/debugreq.py",
    "platform/jobs/memory.py", "platform/jobs/memory_more.py", "platform/jobs/encoding.py",
    "platform/jobs/record_edits.py", "platform/jobs/memory_security.py",
    "platform/security/tokens.py", "platform/security/apikeys.py",
    "platform/security/redis_acl.py", "platform/security/audit.py",
    "platform/observability/metrics.py", "platform/observability/scrape_targets.py",
    "platform/observability/logjson.py",
]
# The scheduler's cycle is Ray-free but still takes the Redis-backed JobStore.
RAY_FREE = [*PURE, "platform/scheduling/scheduler.py"]
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


# No raw Redis client outside the store: platform/jobs holds every Redis operation
# (the `r` attribute of `JobStore` is its client). Each exception says why.
RAW_CLIENT_EXCEPTIONS = {
    # A rank's heartbeat thread keeps a client of its own with tight timeouts (the
    # store's retries for seconds); its writes are the store's own pipeline writes.
    "workers/runtime/heartbeat.py": "the heartbeat thread's own client",
    "workers/runtime/debug.py": "answers on the heartbeat thread's client",
    # `kc doctor` probes a URL it is given, before any store exists.
    "platform/runtime/doctor_probe.py": "probes a URL",
    # The API engineer's files (not this change's to edit): their reads have store
    # methods (`ping`, `metric_fields`, `progress`, `info`, `beats`) to move to.
    "api/server/routers/health.py": "to move to store.ping()",
    "api/server/cluster_metrics.py": "to move to store methods",
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
