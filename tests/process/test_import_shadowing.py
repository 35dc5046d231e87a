"""`platform/` never shadows the standard library, even with the repository root
first on sys.path (`python -m pytest` from the root, `ray job submit --working-dir .`)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_platform_torch_ray_works_with_repo_root_first_on_sys_path():
    code = ("import sys; sys.path.insert(0, '.'); import platform, torch, ray; "
            "assert platform.system(); assert platform.__file__.endswith('platform.py'), "
            "platform.__file__; print(platform.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert str(ROOT) not in out.stdout
