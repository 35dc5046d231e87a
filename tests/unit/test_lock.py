"""The lock (constraints.txt): every dependency pinned, inside pyproject's ranges, and installed as pinned."""

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"constraints.txt: {line!r} is not an exact pin (name==version)"
            out[canonicalize_name(name)] = version
    return out


def requirements() -> list[Requirement]:
    project = PYPROJECT["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    return [Requirement(r) for r in reqs]


def test_every_dependency_is_pinned_inside_its_range():
    pinned = pins()
    for req in requirements():
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req.name} is not in constraints.txt: run `make lock`"
        assert req.specifier.contains(pinned[name], prereleases=True), (
            f"constraints.txt pins {req.name}=={pinned[name]}, outside pyproject's {req}: run `make lock`")


def test_installed_versions_are_the_locked_ones():
    # The lock is only worth its name if `make install` really installs it.
    wrong = []
    for name, version in pins().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # a platform-only dependency of another package
        if installed.split("+")[0] != version:
            wrong.append(f"{name} {installed} (locked {version})")
    assert not wrong, f"installed off the lock: {wrong}; `make install` installs it"


def test_make_install_uses_the_lock():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^LOCK := constraints\.txt$", makefile, re.M)
    assert re.search(r"pip install -q -c \$\(LOCK\) -e \"\.\[dev,hf\]\"", makefile)
    assert re.search(r"^\$\(VENV\)/\.installed: pyproject\.toml \$\(LOCK\)$", makefile, re.M)
