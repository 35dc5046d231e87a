"""An object-store `checkpoint.path` in a job spec (platform/spec/checkpoint.py, through
`validate_spec`) and at admission (platform/security/admission.py `check_paths`): the
scheme must be one this install opens, the URL must lie under the operator's
`KC_CHECKPOINT_URLS`, and `local_staging` is a folder on each node, held to the
checkpoint roots when absolute."""

from __future__ import annotations

import pytest

from kuangchao.platform.errors import SpecError
from kuangchao.platform.security.admission import check_paths
from kuangchao.platform.spec.jobspec import validate_spec

ROOTS = ("/kc/ckpt",)
URLS = ("s3://bucket/ckpt", "memory://team/runs")


def spec_errors(checkpoint: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        validate_spec({"checkpoint": checkpoint})
    return dict(info.value.errors)


def admission_errors(path: str, **kw) -> dict[str, str]:
    kw.setdefault("checkpoint_urls", URLS)
    with pytest.raises(SpecError) as info:
        check_paths(None, path, (), ROOTS, **kw)
    return dict(info.value.errors)


# -- the spec -------------------------------------------------------------------------


def test_an_s3_path_with_a_relative_staging_folder_is_a_valid_spec():
    section = validate_spec({"checkpoint": {"path": "s3://bucket/ckpt",
                                            "local_staging": "staging"}}).checkpoint
    assert (section.path, section.local_staging) == ("s3://bucket/ckpt", "staging")
    assert validate_spec({"checkpoint": {"path": "s3://bucket/ckpt"}}).checkpoint.local_staging is None
    assert validate_spec({"checkpoint": {"path": "memory://b/c"}}).checkpoint.path == "memory://b/c"


def test_an_unknown_scheme_is_refused_naming_checkpoint_path():
    errors = spec_errors({"path": "nosuchstore://bucket/ckpt"})
    assert set(errors) == {"checkpoint.path"}
    assert "unknown URL scheme 'nosuchstore'" in errors["checkpoint.path"]


@pytest.mark.parametrize("path", ["s3://bucket/ckpt/../other", "s3://bucket//ckpt", "s3:///ckpt",
                                  "s3://bucket/ckpt?versionId=1"])
def test_a_malformed_url_is_refused_naming_checkpoint_path(path):
    assert set(spec_errors({"path": path})) == {"checkpoint.path"}


def test_staging_with_a_folder_checkpoint_path_is_refused_naming_local_staging():
    errors = spec_errors({"path": "/kc/ckpt", "local_staging": "staging"})
    assert set(errors) == {"checkpoint.local_staging"}
    assert "drop local_staging" in errors["checkpoint.local_staging"]
    # the default path (a folder) too
    assert set(spec_errors({"local_staging": "/scratch/staging"})) == {"checkpoint.local_staging"}


@pytest.mark.parametrize("staging", ["s3://bucket/staging", "memory://b/staging"])
def test_a_url_as_staging_folder_is_refused(staging):
    errors = spec_errors({"path": "s3://bucket/ckpt", "local_staging": staging})
    assert set(errors) == {"checkpoint.local_staging"}
    assert "not a URL" in errors["checkpoint.local_staging"]


# -- admission ------------------------------------------------------------------------


def test_a_url_under_an_allowed_prefix_is_admitted():
    check_paths(None, "s3://bucket/ckpt", (), ROOTS, checkpoint_urls=URLS)
    check_paths(None, "s3://bucket/ckpt/team-a", (), ROOTS, checkpoint_urls=URLS)
    check_paths(None, "memory://team/runs/x", (), ROOTS, checkpoint_urls=URLS)


@pytest.mark.parametrize("path", ["s3://bucket/ckpt2/x", "s3://bucket/other", "s3://bucket",
                                  "s3://other/ckpt", "memory://bucket/ckpt"])
def test_a_url_outside_every_allowed_prefix_is_refused_naming_the_setting(path):
    errors = admission_errors(path)
    assert set(errors) == {"checkpoint.path"}
    assert "outside the object-store prefixes" in errors["checkpoint.path"]
    assert "KC_CHECKPOINT_URLS" in errors["checkpoint.path"]


def test_a_url_is_refused_when_no_prefix_is_configured():
    errors = admission_errors("s3://bucket/ckpt", checkpoint_urls=())
    assert set(errors) == {"checkpoint.path"}
    assert "lets jobs read none" in errors["checkpoint.path"]
    assert "KC_CHECKPOINT_URLS" in errors["checkpoint.path"]


def test_a_dot_dot_spelling_of_another_prefix_is_refused():
    errors = admission_errors("s3://bucket/ckpt/../secrets")
    assert set(errors) == {"checkpoint.path"} and "'..'" in errors["checkpoint.path"]


def test_a_url_is_not_held_to_the_folder_roots():
    # the roots are for folders; a URL under an allowed prefix needs none of them
    check_paths(None, "s3://bucket/ckpt/x", (), (), checkpoint_urls=URLS)


@pytest.mark.parametrize("staging", ["/etc", "/kc/ckpt-other/staging", "/kc/ckpt/../secrets",
                                     "~/staging"])
def test_an_absolute_staging_folder_outside_the_roots_is_refused_naming_local_staging(staging):
    errors = admission_errors("s3://bucket/ckpt", local_staging=staging)
    assert set(errors) == {"checkpoint.local_staging"}
    assert "KC_CHECKPOINT_ROOTS" in errors["checkpoint.local_staging"]


def test_an_absolute_staging_folder_under_a_root_is_admitted():
    check_paths(None, "s3://bucket/ckpt", (), ROOTS, checkpoint_urls=URLS,
                local_staging="/kc/ckpt/staging")


def test_a_relative_staging_folder_is_admitted_it_lies_under_each_nodes_own_folder():
    check_paths(None, "s3://bucket/ckpt", (), ROOTS, checkpoint_urls=URLS, local_staging="staging")
    check_paths(None, "s3://bucket/ckpt", (), ROOTS, checkpoint_urls=URLS, local_staging="a/b")


def test_a_bad_url_and_a_bad_staging_folder_are_both_reported():
    errors = admission_errors("s3://other/ckpt", local_staging="/etc")
    assert set(errors) == {"checkpoint.path", "checkpoint.local_staging"}


def test_a_relative_staging_folder_that_climbs_out_of_the_node_folder_is_refused():
    with pytest.raises(SpecError) as info:
        validate_spec({"checkpoint": {"path": "s3://bucket/ckpt", "local_staging": "../../etc"}})
    assert "checkpoint.local_staging" in info.value.message and "'..'" in info.value.message


@pytest.mark.parametrize("path", ["s3://bucket/ckpt/*", "s3://bucket/ckpt/[ab]"])
def test_a_wildcard_in_a_checkpoint_url_is_refused(path):
    with pytest.raises(SpecError) as info:
        validate_spec({"checkpoint": {"path": path}})
    assert "checkpoint.path" in info.value.message and "no wildcards" in info.value.message


def test_a_file_url_is_refused_for_a_plain_path():
    with pytest.raises(SpecError) as info:
        validate_spec({"checkpoint": {"path": "file:///data/ckpt"}})
    assert "checkpoint.path" in info.value.message and "plain path" in info.value.message
