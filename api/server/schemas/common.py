"""Bases of the response models, and the error bodies every router shares.

Routes build plain dicts; FastAPI validates them against these models and
serializes the result. Two rules keep the JSON exactly what the dicts hold:

- `strict`: no value is coerced on the way out (a float never becomes an int,
  `True` never becomes 1). `Number` keeps ints as ints and floats as floats.
- `Public` forbids undeclared keys: a field added to a view but not to its model
  makes the route fail loudly in tests instead of vanishing from the answer.
  `Passthrough` is for documents another component writes (a rank's log line,
  the registry's node entry): their declared fields are checked, and any other
  key passes through untouched.

Routes whose documents may omit a declared key use `response_model_exclude_unset`,
so an absent key stays absent rather than coming back as null.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

# int or float, each kept as it is (pydantic's `float` turns 1 into 1.0).
Number = Annotated[int | float, WithJsonSchema({"type": "number"})]


class Public(BaseModel):
    """A closed response object: every key it may carry is declared."""

    model_config = ConfigDict(strict=True, extra="forbid")


class Passthrough(BaseModel):
    """A response object written by another component; undeclared keys pass through."""

    model_config = ConfigDict(strict=True, extra="allow")


class Problem(Public):
    """An error: 4xx and 503 answers carry the cause and the setting to change."""

    detail: str


class FieldProblem(Public):
    loc: list[str | int] = Field(description="the path to the bad value")
    msg: str
    field: str = Field(description="`loc` joined with dots")


class ValidationProblem(Public):
    """A 422: one entry per bad value (app.py's handler and `deps.spec_422`)."""

    detail: list[FieldProblem]


_WHY = {
    401: "No API key, or one that is unknown, revoked or expired",
    403: "The key's role may not do this",
    404: "No such resource, or one of a tenant the key may not see",
    409: "The resource is in a state that does not allow this",
    413: "The request body is larger than the server takes",
    422: "The request, or the document in it, is invalid",
    429: "Too many such requests are in flight; retry after the time in Retry-After",
    503: "Redis is unavailable",
}


def errors(*codes: int, inline: bool = False) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route or router: its error answers and their bodies.

    A route with parameters must list 422: FastAPI would otherwise document its
    own validation error, whose entries lack our `field` and carry a `type`.
    `inline` spells the JSON schema out, for a route whose own answer is not
    JSON (FastAPI would file a `model` under the route's media type).
    """
    out: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        model = ValidationProblem if code == 422 else Problem
        out[code] = ({"description": _WHY[code], "content": {
                          "application/json": {"schema": model.model_json_schema()}}}
                     if inline else {"model": model, "description": _WHY[code]})
    return out
