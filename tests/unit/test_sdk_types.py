"""The SDK's views (api/sdk/types.py) against the server's response models
(api/server/schemas/): the SDK stays free of FastAPI and pydantic, so this test
is what keeps the two in step.

Each key a view's attribute reads must be a field of the matching model, of a
type the attribute's annotation covers. An attribute that indexes `self[key]`
needs a field that is always there and never null; one that reads `self.get(key)`
must admit None; `self._get(key, default)` gives a default for both.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
import typing
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints

import pytest
from pydantic import BaseModel

from kuangchao.api.sdk import types as sdk
from kuangchao.api.server.schemas import jobs as schemas
from kuangchao.api.server.schemas.common import Passthrough

PAIRS: dict[type[sdk.View], type[BaseModel]] = {
    sdk.Job: schemas.JobPublic,
    sdk.Progress: schemas.ProgressPublic,
    sdk.Placement: schemas.PlacementPublic,
    sdk.Checkpoint: schemas.CheckpointPublic,
    sdk.Goodput: schemas.GoodputPublic,
    sdk.Event: schemas.EventPublic,
    sdk.LogLine: schemas.LogLinePublic,
    sdk.MetricPoint: schemas.MetricPointPublic,
    sdk.EventPage: schemas.EventList,
    sdk.LogPage: schemas.LogList,
    sdk.MetricsPage: schemas.MetricPointList,
}


def options(tp: Any) -> list[Any]:
    """The alternatives of a type: unions flattened, `Annotated` unwrapped."""
    if get_origin(tp) is Annotated:
        return options(get_args(tp)[0])
    if get_origin(tp) in (typing.Union, types.UnionType):
        return [o for arg in get_args(tp) for o in options(arg)]
    return [tp]


def covers(sdk_tp: Any, model_tp: Any) -> bool:
    """Whether a value of `model_tp` (one alternative) fits the SDK's `sdk_tp`."""
    if sdk_tp is Any or model_tp is Any:
        return True
    if get_origin(model_tp) is Literal:
        return all(covers(sdk_tp, type(v)) for v in get_args(model_tp))
    if isinstance(sdk_tp, type) and issubclass(sdk_tp, sdk.View):
        return model_tp is PAIRS.get(sdk_tp)
    s_origin, m_origin = get_origin(sdk_tp) or sdk_tp, get_origin(model_tp) or model_tp
    if s_origin in (list, dict):
        if s_origin is not m_origin:
            return False
        s_args, m_args = get_args(sdk_tp), get_args(model_tp)
        return not s_args or not m_args or all(
            any(covers(s, m) for s in options(sa)) for sa, ma in zip(s_args, m_args, strict=True)
            for m in options(ma))
    if sdk_tp is float and model_tp is int:  # JSON numbers: an int reads fine as a float
        return True
    return sdk_tp is model_tp


def properties(view: type[sdk.View]) -> dict[str, property]:
    out: dict[str, property] = {}
    for cls in reversed(view.__mro__[:view.__mro__.index(sdk.View)]):
        out.update({k: v for k, v in vars(cls).items() if isinstance(v, property)})
    return out


def reads(view: type[sdk.View], prop: property) -> list[tuple[str, str]]:
    """(how, key) for each key the attribute reads: `index`, `get` or `default`."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(prop.fget)))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _is_self(node.value):
            found.append(("index", _key(view, node.slice)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and _is_self(node.func.value) and node.func.attr in ("get", "_get")):
            how = "default" if node.func.attr == "_get" and len(node.args) > 1 else "get"
            found.append((how, _key(view, node.args[0])))
    return found


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _key(view: type[sdk.View], node: ast.AST) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    assert isinstance(node, ast.Attribute) and _is_self(node.value), ast.dump(node)
    return str(getattr(view, node.attr))  # `self.entry_key`


def test_every_view_of_the_sdk_has_a_response_model():
    views = {v for v in vars(sdk).values() if isinstance(v, type) and issubclass(v, sdk.View)}
    assert views - {sdk.View, sdk.Page} == set(PAIRS)


@pytest.mark.parametrize("view", list(PAIRS), ids=lambda v: v.__name__)
def test_sdk_view_reads_only_what_its_response_model_declares(view):
    model = PAIRS[view]
    checked = 0
    for name, prop in properties(view).items():
        hints = get_type_hints(prop.fget, vars(sdk))
        returns = hints["return"]
        admits_none = type(None) in options(returns)
        for how, key in reads(view, prop):
            field = model.model_fields.get(key)
            assert field is not None, f"{view.__name__}.{name} reads {key!r}, which " \
                                      f"{model.__name__} does not declare"
            field_options = options(field.annotation)
            nullable = type(None) in field_options or not field.is_required()
            if how == "index":
                assert not nullable, f"{view.__name__}.{name} indexes {key!r}, which " \
                                     f"{model.__name__} may omit or send as null"
            if how == "get":
                assert admits_none or not nullable, (
                    f"{view.__name__}.{name} -> {returns} reads {key!r} with .get, "
                    "which gives None when it is absent")
            if name != "entries":  # a page's entries: test_sdk_page_entries_...
                alternatives = [o for o in field_options if o is not type(None)]
                assert all(any(covers(s, m) for s in options(returns)) for m in alternatives), (
                    f"{view.__name__}.{name} -> {returns} does not cover {model.__name__}.{key}: "
                    f"{field.annotation}")
            checked += 1
    assert checked, f"{view.__name__} reads no key"


@pytest.mark.parametrize("page", [sdk.EventPage, sdk.LogPage, sdk.MetricsPage],
                         ids=lambda v: v.__name__)
def test_sdk_page_entries_are_the_list_of_their_entry_model(page):
    model = PAIRS[page]
    field = model.model_fields[page.entry_key]
    assert field.is_required() and covers(list[page.entry_type], field.annotation)
    assert model.model_fields["next"].annotation is int


def test_sdk_views_of_documents_other_components_write_are_open_models():
    # A view reads a missing key as None; the model must not refuse what such a
    # document may add, or the SDK would meet keys the schema says cannot be there.
    for view in (sdk.Event, sdk.LogLine, sdk.MetricPoint, sdk.Checkpoint):
        assert issubclass(PAIRS[view], Passthrough), view.__name__


class _Renamed(sdk.Job):
    @property
    def stage(self) -> str:
        return str(self["stage"])


class _Strict(sdk.Job):
    @property
    def owner(self) -> str:  # type: ignore[override]
        return str(self["owner"])


@pytest.mark.parametrize("view, complaint", [(_Renamed, "'stage', which JobPublic does not"),
                                             (_Strict, "may omit or send as null")],
                         ids=["a key the model lacks", "a key the model may omit"])
def test_the_check_catches_a_view_out_of_step_with_its_model(view, complaint):
    PAIRS[view] = schemas.JobPublic
    try:
        with pytest.raises(AssertionError, match=complaint):
            test_sdk_view_reads_only_what_its_response_model_declares(view)
    finally:
        del PAIRS[view]
