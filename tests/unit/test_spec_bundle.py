"""A job YAML uploaded with the files its `extends:` names (the console's Submit
page): resolved among those files only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kuangchao.platform.errors import SpecError
from kuangchao.platform.spec.jobspec import load_spec_document, validate_spec
from kuangchao.platform.spec.text import parse_bundle

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def bundle(main: str, **files: str) -> str:
    return json.dumps({"main": main, "files": files})


def test_an_uploaded_example_merges_as_kc_submit_merges_it():
    files = {n: (EXAMPLES / n).read_text() for n in ("tiny-gpt.yaml", "base.yaml")}
    doc = parse_bundle(json.dumps({"main": "tiny-gpt.yaml", "files": files}))
    assert doc == load_spec_document(EXAMPLES / "tiny-gpt.yaml")
    assert validate_spec(doc).model.d_model == 64


def test_parents_are_found_by_file_name_only_and_never_read_from_disk():
    doc = parse_bundle(bundle("job.yaml", **{"job.yaml": "extends: ../../etc/base.yaml\ntask: {name: a}\n",
                                             "base.yaml": "training: {steps: 5}\n"}))
    assert doc == {"training": {"steps": 5}, "task": {"name": "a"}}


@pytest.mark.parametrize("text, field, needle", [
    (bundle("job.yaml", **{"job.yaml": "extends: base.yaml\n"}), "extends", "was not uploaded"),
    (bundle("a.yaml", **{"a.yaml": "extends: b.yaml\n", "b.yaml": "extends: a.yaml\n"}),
     "extends", "cycle in extends chain: a.yaml -> b.yaml -> a.yaml"),
    (bundle("a.yaml", **{"a.yaml": "extends: [x]\n"}), "extends", "must be a file name"),
    (bundle("a.yaml", **{"a.yaml": "extends: b.yaml\n", "b.yaml": "- not a mapping\n"}), "",
     "b.yaml: a job spec must be a mapping"),
    (json.dumps({"main": "x.yaml", "files": {"a.yaml": ""}}), "", "`main` among them"),
    (json.dumps({"main": "a", "files": {f"f{i}": "" for i in range(17)}}), "", "1 to 16 files"),
    ("not json", "", "a bundle is JSON"),
])
def test_a_bad_bundle_names_what_is_wrong(text, field, needle):
    with pytest.raises(SpecError) as err:
        parse_bundle(text)
    (path, message), = err.value.errors
    assert path == field and needle in message
