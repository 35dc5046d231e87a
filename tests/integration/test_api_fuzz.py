"""Schemathesis against the API's own /openapi.json: no input, however odd, gets a 5xx,
and every answer matches what the schema documents for its status: the body its
response model (api/server/schemas/) describes, under the documented media type.

The API runs as a real uvicorn server on a free port, on the real Redis (else
an embedded Valkey) under a key prefix of its own, with an admin key written
straight to Redis, so every route is reached past authentication. Every
generated request carries that key; any 4xx is a fine answer, while a 5xx, a
dropped connection, or a body (4xx included) that does not match its documented
schema fails the operation's test. Each operation is fuzzed
twice: with the path parameters schemathesis makes up (mostly 404s), and
with them naming a job, key or node that exists.

`make test` runs a bounded, repeatable campaign (KC_FUZZ_EXAMPLES=25 examples
per operation and phase, KC_FUZZ_SEED=1); `make fuzz` a longer one with a new
seed each run.
"""

from __future__ import annotations

import collections
import copy
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

from kuangchao.api.server.app import app
from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.runtime.procs import free_port
from kuangchao.platform.security.keystore import KeyStore
from kuangchao.platform.spec.jobspec import JobSpec

from .conftest import redis_prefix, wait_for

pytestmark = pytest.mark.integration

MAX_EXAMPLES = int(os.environ.get("KC_FUZZ_EXAMPLES", "25"))
# A fixed seed keeps `make test` repeatable; `make fuzz` draws a new one each run
# (KC_FUZZ_SEED=random) and prints it, so that a failure can be replayed.
SEED = os.environ.get("KC_FUZZ_SEED", "1")

# What the run saw, per operation: answers by status, for the summary.
SEEN: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]


class Api:
    def __init__(self, base: str, key: str, log: Path) -> None:
        self.base, self.key, self.log = base, key, log
        self.headers = {"Authorization": f"Bearer {key}"}
        # Path parameters that name something real, so that a share of the
        # generated requests gets past the 404 into the route's own code.
        self.known: dict[str, list[str]] = {}

    def log_tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def api(tmp_path_factory, request):
    home = tmp_path_factory.mktemp("kcfuzz")
    with redis_prefix("kcfuzz") as (url, prefix):
        store = JobStore.from_url(url, prefix)
        keys = KeyStore(store)
        key, _ = keys.create("fuzz", "default", "admin")
        _, spare = keys.create("spare", "default", "viewer")  # for DELETE /v1/admin/keys/{key_id}
        store.quarantine_node("fuzz-node", {"since": time.time(), "until": time.time() + 86400,
                                            "failures": 3, "reason": "seeded by test_api_fuzz"})
        port = free_port()
        # Only this stack's settings: no KC_* of the caller's shell leaks in.
        env = {k: v for k, v in os.environ.items() if not k.startswith("KC_") and k != "RAY_ADDRESS"}
        env.update(KC_REDIS_URL=url, KC_REDIS_PREFIX=prefix, KC_HOME=str(home))
        log = home / "api.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kuangchao.api.server", "--host", "127.0.0.1", "--port", str(port)],
                env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_for(lambda: proc.poll() is not None or _healthy(base), 60,
                     "the API server to answer /healthz", interval=0.1)
            assert proc.poll() is None, f"the API server exited:\n{log.read_text(errors='replace')}"
            api = Api(base, key, log)
            api.known = {"job_id": _seed_jobs(api), "key_id": [spare.key_id], "name": ["fuzz-node"],
                         "kind": ["comm", "memory", "gradient"], "profile_id": ["0123456789ab"]}
            yield api
            _report(request, log)
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=15)


def _seed_jobs(api: Api) -> list[str]:
    """A queued job, a queued elastic one and a cancelled one (no scheduler runs here)."""
    docs = [{"task": {"name": "fuzz-plain"}},
            {"task": {"name": "fuzz-elastic"}, "elastic": {"min_replicas": 2, "max_replicas": 8},
             "parallel": {"data_parallel_size": 4, "micro_batch_size": 4, "gradient_accumulation_steps": 2}},
            {"task": {"name": "fuzz-cancelled"}}]
    ids = []
    for doc in docs:
        resp = httpx.post(f"{api.base}/v1/jobs", json=doc, headers=api.headers, timeout=10)
        assert resp.status_code == 201, resp.text
        ids.append(resp.json()["id"])
    resp = httpx.post(f"{api.base}/v1/jobs/{ids[-1]}/cancel", headers=api.headers, timeout=10)
    assert resp.status_code == 200, resp.text
    return ids


def _report(request, log: Path) -> None:
    """One line per operation on the terminal, with or without -s."""
    lines = [f"schemathesis {schemathesis.__version__}: {len(SEEN)} operations, "
             f"{sum(sum(c.values()) for c in SEEN.values())} requests "
             f"(KC_FUZZ_EXAMPLES={MAX_EXAMPLES} per operation and phase, "
             f"KC_FUZZ_SEED={schema.config.seed}); server log: {log}"]
    for label, statuses in sorted(SEEN.items()):
        lines.append(f"  {label:40} {sum(statuses.values()):5}  "
                     + " ".join(f"{s}x{n}" for s, n in sorted(statuses.items())))
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if capture is None or reporter is None:
        print("\n".join(lines))
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        for line in lines:
            reporter.write_line(line)


def _with_job_body(doc: dict[str, Any]) -> dict[str, Any]:
    """The served schema, plus a body for `POST /v1/jobs`.

    That route reads its body itself (JSON or YAML), so /openapi.json declares
    none and schemathesis would only ever send an empty one. Declaring the
    job spec's own JSON schema lets it reach spec validation and `jobs.submit`.
    """
    doc = copy.deepcopy(doc)
    spec = JobSpec.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name, sub in spec.pop("$defs", {}).items():
        assert name not in schemas, f"{name} is in /openapi.json already"
        schemas[name] = sub
    submit = doc["paths"]["/v1/jobs"]["post"]
    if "requestBody" not in submit:
        submit["requestBody"] = {"required": True, "content": {"application/json": {"schema": spec}}}
    return doc


def _schema() -> Any:
    """The schema under test, built at import: `parametrize` needs it to collect.

    It is the app's own OpenAPI document; `test_served_schema_is_the_one_fuzzed`
    checks that /openapi.json serves exactly it. (`schemathesis.pytest.from_fixture`
    would load it from the live server instead, but its lazy mode does not run on
    pytest >= 9.2, which has no `Node._nodeid`.)
    """
    config = schemathesis.Config(seed=None if SEED == "random" else int(SEED))
    config.projects.default.update(request_timeout=30)
    config.projects.default.generation.update(max_examples=MAX_EXAMPLES, database="none")
    return schemathesis.openapi.from_dict(_with_job_body(app.openapi()), config=config)


schema = _schema()


def test_served_schema_is_the_one_fuzzed(api: Api):
    resp = httpx.get(f"{api.base}/openapi.json", headers=api.headers, timeout=10)
    assert resp.status_code == 200, resp.text
    assert resp.json() == app.openapi()


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_input_gets_a_server_error(case, api: Api):
    _exercise(case, api)


@schema.include(path_regex=r"\{").parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_input_about_a_real_resource_gets_a_server_error(case, api: Api):
    """The same, with each path parameter naming a job, key or node that exists."""
    for name, value in case.path_parameters.items():
        known = api.known[name]
        case.path_parameters[name] = known[zlib.crc32(str(value).encode()) % len(known)]
    _exercise(case, api)


def _exercise(case, api: Api) -> None:
    try:
        response = case.call(base_url=api.base, headers=api.headers, timeout=30)
    except Exception as exc:  # a dropped connection is as bad as a 500
        pytest.fail(f"{case.operation.label}: no response ({exc!r})\n{case.as_curl_command()}\n"
                    f"server log:\n{api.log_tail()}")
    SEEN[case.operation.label][response.status_code] += 1
    # Some generated cases drop or mangle the Authorization header on purpose
    # (401 is right for those); one that sent our key must never be refused,
    # or the run revoked it and everything after it tests only authentication.
    if response.request.headers.get("Authorization") == api.headers["Authorization"]:
        assert response.status_code != 401, f"{case.operation.label} refused our key: {response.text}"
    try:
        case.validate_response(response, checks=CHECKS, headers=api.headers)
    except BaseException:
        time.sleep(0.2)  # let the server flush its traceback
        print(f"server log:\n{api.log_tail()}")
        raise
