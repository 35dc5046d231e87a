"""Guards on the code's shape: layering, and no shadowing of the stdlib."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PURE = ["platform/spec.py", "platform/state.py", "platform/placement.py", "platform/policies.py",
        "platform/queues.py", "platform/placement_score.py",
        "platform/topology.py", "platform/scheduler.py", "platform/errors.py",
        "platform/elastic.py", "platform/elastic_policy.py", "platform/tokens.py",
        "platform/apikeys.py", "platform/redis_acl.py", "platform/audit.py",
        "platform/planner.py", "platform/hardware.py", "platform/metrics.py",
        "platform/debugreq.py", "platform/scrape_targets.py", "platform/logjson.py",
        "platform/autoplan.py"]


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_import_platform_torch_ray_works_with_repo_root_first_on_sys_path():
    code = ("import sys; sys.path.insert(0, '.'); import platform, torch, ray; "
            "assert platform.system(); assert platform.__file__.endswith('platform.py'), "
            "platform.__file__; print(platform.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert str(ROOT) not in out.stdout


def test_code_folders_have_no_init_file():
    for folder in ("platform", "workers", "api"):
        assert not (ROOT / folder / "__init__.py").exists(), folder


def test_pure_modules_never_import_ray():
    for rel in PURE:
        bad = {m for m in imports(ROOT / rel) if m == "ray" or m.startswith("ray.")}
        assert not bad, f"{rel} imports {bad}"


def test_workers_never_import_api():
    for path in (ROOT / "workers").rglob("*.py"):
        bad = {m for m in imports(path) if m.startswith("kuangchao.api")}
        assert not bad, f"{path} imports {bad}"


def test_platform_never_imports_api():
    for path in (ROOT / "platform").rglob("*.py"):
        bad = {m for m in imports(path) if m.startswith("kuangchao.api")}
        assert not bad, f"{path} imports {bad}"
