"""What a submitter may ask for (platform/security/admission.py), and the API's
answer to a submitter who asks for more: 403 for what the role or tenant may
not have, 422 for paths outside the roots, and nothing stored either way."""

from __future__ import annotations

import pytest

from kuangchao.platform.errors import AdmissionRefused, SpecError
from kuangchao.platform.security import admission
from kuangchao.platform.security.admission import (
    DEFAULT_LIMITS,
    RoleLimits,
    check_paths,
    check_request,
    limits_from_json,
    roots_from,
)
from kuangchao.platform.spec.queues import parse_queues

from .test_api_edge import SPEC, api  # noqa: F401 -- the fixture


def ask(role="submitter", tenant="vision", priority=50, queue_tenants=None, restarts=3,
        data_bytes=4_000_000, limits=None):
    check_request(role, tenant, priority, queue_tenants, "q", restarts, data_bytes,
                  limits or DEFAULT_LIMITS)


def test_a_submitter_may_use_every_named_priority_but_not_more():
    ask(priority=100)
    with pytest.raises(AdmissionRefused) as info:
        ask(priority=10**15)
    assert info.value.errors == [("task.priority", "1000000000000000 is above what role "
                                                   "submitter may ask for (100); use at most that")]
    ask(role="operator", priority=1000)


def test_ceilings_on_restarts_and_data_and_every_refusal_at_once():
    with pytest.raises(AdmissionRefused) as info:
        ask(priority=101, restarts=10**6, data_bytes=1 << 40, queue_tenants=("nlp",))
    assert [f for f, _ in info.value.errors] == [
        "task.queue", "task.priority", "fault_tolerance.max_restarts", "data.max_bytes"]
    assert "queue 'q' takes jobs of tenants nlp, not 'vision'" in info.value.errors[0][1]


def test_a_viewer_or_an_unknown_role_may_ask_for_nothing():
    with pytest.raises(AdmissionRefused):
        ask(role="viewer")
    with pytest.raises(AdmissionRefused):
        ask(role="no-such-role")


def test_the_queue_document_sets_limits_over_the_defaults_role_by_role():
    table = parse_queues({"queues": [{"name": "a", "tenants": ["vision"]}],
                          "limits": {"submitter": {"max_priority": 10}}})
    limits = limits_from_json(table.limits)
    assert limits["submitter"] == RoleLimits(10, DEFAULT_LIMITS["submitter"].max_restarts,
                                             DEFAULT_LIMITS["submitter"].max_data_bytes)
    assert limits["operator"] == DEFAULT_LIMITS["operator"]
    with pytest.raises(SpecError) as info:
        parse_queues({"queues": [{"name": "a"}], "limits": {"root": {"max_priority": 1}}})
    assert "limits.root" in str(info.value)


def test_paths_must_lie_under_their_roots_as_written_and_normalised(tmp_path):
    data, ckpt = (str(tmp_path / "data"),), (str(tmp_path),)
    check_paths(str(tmp_path / "data" / "corpus.bin"), str(tmp_path / "ckpt"), data, ckpt)
    check_paths(None, str(tmp_path), data, ckpt)
    for bad_data, bad_ckpt in [
            (str(tmp_path / "credentials"), str(tmp_path / "ckpt")),
            (str(tmp_path / "data" / ".." / "credentials"), str(tmp_path / "c")),
            (str(tmp_path / "data-other" / "x"), str(tmp_path / "c")),
            (None, "/dev/shm/x"), (None, str(tmp_path) + "-sibling")]:
        with pytest.raises(SpecError) as info:
            check_paths(bad_data, bad_ckpt, data, ckpt)
        assert "outside the folders jobs may use here" in str(info.value)


def test_roots_come_from_a_colon_separated_setting_or_the_default(tmp_path):
    assert roots_from(f"{tmp_path}/a/:{tmp_path}//b", ("/x",)) == (f"{tmp_path}/a", f"{tmp_path}/b")
    assert roots_from("", ("~/d",))[0].endswith("/d") and roots_from(None, ("/x",)) == ("/x",)
    assert admission.under("/x/y", ("/x",)) and not admission.under("/xy", ("/x",))


# -- through the API -----------------------------------------------------------------

def test_the_api_refuses_what_the_role_may_not_ask_for_with_403_and_stores_nothing(api):  # noqa: F811
    store, client, _ = api
    resp = client.post("/v1/jobs", json={**SPEC, "task": {"name": "x", "priority": 10**15}})
    assert resp.status_code == 403 and "task.priority" in resp.json()["detail"]
    resp = client.post("/v1/jobs?dry_run=true",
                       json={**SPEC, "fault_tolerance": {"max_restarts": 10**6}})
    assert resp.status_code == 403 and "max_restarts" in resp.json()["detail"]
    assert store.list() == []
    denials = [r for r in store.audit_lines(None) if '"deny"' in r and "job.submit" in r]
    assert len(denials) == 2


def test_the_api_keeps_a_queue_to_its_tenants(api):  # noqa: F811
    store, client, _ = api
    store.set_info("queues", parse_queues({"queues": [
        {"name": "default"}, {"name": "nlp-only", "tenants": ["nlp"]}]}).to_json())
    resp = client.post("/v1/jobs", json={**SPEC, "task": {"name": "x", "queue": "nlp-only"}})
    assert resp.status_code == 403 and "takes jobs of tenants nlp" in resp.json()["detail"]
    assert client.post("/v1/jobs", json=SPEC).status_code == 201
    queues = client.get("/v1/queues").json()
    assert [q["tenants"] for q in queues["queues"]] == [None, ["nlp"]]
    assert queues["limits"]["submitter"]["max_priority"] == 100


def test_the_api_refuses_paths_outside_the_roots_with_422(api, tmp_path):  # noqa: F811
    store, client, _ = api
    for doc in ({**SPEC, "data": {"path": str(tmp_path / "credentials")}},
                {**SPEC, "checkpoint": {"path": "/dev/shm/grab"}}):
        resp = client.post("/v1/jobs", json=doc)
        assert resp.status_code == 422 and "outside the folders jobs may use" in resp.text
    ok = {**SPEC, "data": {"path": str(tmp_path / "data" / "mine.bin")},
          "checkpoint": {"path": str(tmp_path / "ckpt")}}
    assert client.post("/v1/jobs", json=ok).status_code == 201
    assert len(store.list()) == 1
