"""One set of 4 gloo ranks for every layout module the session runs.

Starting the rank processes (importing torch, and transformers for the Hugging Face
cases) is most of a layout case's cost on a small machine, so the modules do not
each start their own: every module that defines `layout_cases(work, request)`
hands its cases to `layout_results`, which runs them all, module by module and in
each module's order (a checkpoint's resumed case after its whole run), on one
batch of ranks (`run_layouts`), and gives each module its own records back. A
session that selects one module (`-k`, a file) runs only that module's cases.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.hf_fixtures import tiny_gpt2, tiny_llama
from tests.layouts.test_layouts import run_layouts


@pytest.fixture(scope="session")
def hf_folders(tmp_path_factory) -> dict[str, Path]:
    """The tiny Hugging Face folders of test_hf_layouts.py (tests/hf_fixtures.py)."""
    root = tmp_path_factory.mktemp("hf-models")
    return {"untied": tiny_llama(root / "llama"), "tied": tiny_llama(root / "llama-tied", tie=True),
            "gpt2": tiny_gpt2(root / "gpt2")}


@pytest.fixture(scope="session")
def layout_results(request, tmp_path_factory) -> dict[str, dict[str, dict]]:
    """module name -> case name -> rank 0's record (or {"error": ...}), for every layout
    module among the session's tests."""
    modules = []
    for item in request.session.items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "layout_cases") and module not in modules:
            modules.append(module)
    work = tmp_path_factory.mktemp("layouts")
    cases: dict[str, dict] = {}
    owners: dict[str, tuple[str, str]] = {}
    for module in modules:
        short = module.__name__.rsplit(".", 1)[-1]
        folder = work / short
        folder.mkdir()
        for name, case in module.layout_cases(folder, request).items():
            key = f"{short}.{name}"  # file names in the shared work folder stay apart
            cases[key] = case
            owners[key] = (module.__name__, name)
    records = run_layouts(cases, work)
    out: dict[str, dict[str, dict]] = {}
    for key, (module_name, name) in owners.items():
        out.setdefault(module_name, {})[name] = records[key]
    return out
