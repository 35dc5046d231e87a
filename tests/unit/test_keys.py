"""Every Redis key is named in platform/jobs/keys.py, matches its pattern, and is in the docs."""

import inspect
import re
from pathlib import Path

import pytest

from kuangchao.platform.jobs import keys

ROOT = Path(__file__).resolve().parents[2]
BUILDERS = {name: fn for name, fn in vars(keys).items()
            if inspect.isfunction(fn) and fn.__module__ == keys.__name__
            and not name.startswith("_") and name != "job_prefix"}


def placeholders(pattern: str) -> list[str]:
    return re.findall(r"\{[^}]*\}", pattern)


def test_every_builder_has_a_pattern_and_every_pattern_a_builder():
    assert set(BUILDERS) == set(keys.PATTERNS)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_builder_makes_its_pattern_under_the_prefix(name):
    pattern = keys.PATTERNS[name]
    assert BUILDERS[name]("kc:", *placeholders(pattern)) == "kc:" + pattern


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_the_architecture_doc_lists_the_key(name):
    table = (ROOT / "docs" / "architecture.md").read_text().split("## Redis keys", 1)[1]
    assert re.search(rf"^\|[^|]*`{re.escape(keys.PATTERNS[name])}`", table, re.M), (
        f"docs/architecture.md's key table has no row for `{keys.PATTERNS[name]}`")


def test_a_jobs_own_keys_share_the_prefix_its_redis_user_may_reach():
    for name, pattern in keys.PATTERNS.items():
        if pattern.startswith("job:{id}:"):
            ids = ["j-1", *["x"] * (len(placeholders(pattern)) - 1)]
            assert BUILDERS[name]("kc:", *ids).startswith(keys.job_prefix("kc:", "j-1"))


def test_builders_fill_ids_in_the_patterns_order():
    assert keys.answer("p:", "j", "r7") == "p:job:j:answer:r7"
    assert keys.events("p:", "j") == "p:job:j:events" and keys.audit("p:") == "p:audit"
