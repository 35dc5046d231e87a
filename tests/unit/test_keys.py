"""Every Redis key is named in platform/jobs/keys.py, matches its pattern, and is in the docs."""

import inspect
import re
from pathlib import Path

import pytest

from kuangchao.platform.jobs import keys

ROOT = Path(__file__).resolve().parents[2]
BUILDERS = {name: fn for name, fn in vars(keys).items()
            if inspect.isfunction(fn) and fn.__module__ == keys.__name__ and name != "job_prefix"}
PLACEHOLDERS = {"job_id": "{id}", "report_id": "{rid}", "request_id": "{rid}", "rank": "{rank}",
                "name": "{name}", "token_id": "{token}"}


def test_every_builder_has_a_pattern_and_every_pattern_a_builder():
    assert set(BUILDERS) == set(keys.PATTERNS)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_builder_makes_its_pattern_under_the_prefix(name):
    fn = BUILDERS[name]
    params = list(inspect.signature(fn).parameters)[1:]
    pattern = keys.PATTERNS[name]
    # the security keys name the job `{job}`
    names = {**PLACEHOLDERS, "job_id": "{job}"} if "{job}" in pattern else PLACEHOLDERS
    assert fn("kc:", *(names[p] for p in params)) == "kc:" + pattern


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_the_architecture_doc_lists_the_key(name):
    table = (ROOT / "docs" / "architecture.md").read_text().split("## Redis keys", 1)[1]
    assert re.search(rf"^\|[^|]*`{re.escape(keys.PATTERNS[name])}`", table, re.M), (
        f"docs/architecture.md's key table has no row for `{keys.PATTERNS[name]}`")


def test_a_jobs_own_keys_share_the_prefix_its_redis_user_may_reach():
    for name, pattern in keys.PATTERNS.items():
        if pattern.startswith("job:{id}:"):
            params = list(inspect.signature(BUILDERS[name]).parameters)[1:]
            assert BUILDERS[name]("kc:", "j-1", *(["x"] * (len(params) - 1))).startswith(
                keys.job_prefix("kc:", "j-1"))
