"""A job spec arriving as text (an API body): parsed, and checked to be a
document a job record can hold.

JSON and YAML allow more than a job record and its JSON responses can carry:
a lone `\\ud800` escape makes a string UTF-8 cannot encode (the job would be
stored, then break every response that lists it); YAML tags make bytes, sets
and pairs, and its aliases can make a cycle; nesting can exhaust the
recursion limit; integers can outgrow what Python prints. Each is refused
here with the field path, before validation.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import yaml

from kuangchao.platform.errors import SpecError

# How deep a submitted spec may nest (`args` is free-form); pydantic refuses
# to serialise much deeper ones.
MAX_DEPTH = 64
# Python will not print an int past 4,300 digits.
MAX_INT_BITS = 14_000
# What a document may grow to once its YAML aliases are expanded, as validation
# and storage expand them: 400 bytes of nested aliases would otherwise make a
# billion values (minutes of CPU and gigabytes in the API). A job spec has a
# few hundred values; `args` is free-form, hence the room.
MAX_VALUES = 100_000
MAX_TEXT_BYTES = 4 << 20


def parse_spec_text(text: str) -> dict[str, Any]:
    """Parse a JSON or YAML request body into a spec document.

    JSON is tried first: it pairs escaped surrogates (an emoji sent as
    `\\ud83d\\ude00`), which PyYAML decodes one by one into two lone halves.

    Raises:
        SpecError: For a body that is neither, is not a mapping, or holds
            something a job record cannot (see the module docstring).
    """
    aliased = False  # JSON has no aliases: its size is the body's, which the API bounds
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        aliased = True
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise SpecError([("", f"body is neither valid JSON nor YAML: {exc}")]) from None
        except (RecursionError, ValueError) as exc:  # too deep; an int or date YAML cannot build
            raise SpecError([("", f"body is not a usable JSON or YAML document: {exc}"[:300])]) from None
    if not isinstance(doc, dict):
        raise SpecError([("", "a job spec must be a mapping at the top level")])
    check_document(doc)
    if aliased:
        check_expanded_size(doc)
    return doc


def check_document(doc: Any) -> None:
    """Walk the document without recursion; `SpecError` at the first value no record can hold."""
    stack: list[tuple[Any, list[str], frozenset[int]]] = [(doc, [], frozenset())]
    seen: set[int] = set()  # an alias met again, not inside itself, was checked already
    while stack:
        value, path, outer = stack.pop()
        if not isinstance(value, dict | list):
            _check_scalar(value, path)
            continue
        if id(value) in outer:
            raise SpecError([(".".join(path), "a YAML alias refers to a value that holds it")])
        if id(value) in seen:
            continue
        seen.add(id(value))
        if len(path) >= MAX_DEPTH:
            raise SpecError([(".".join(path), f"is nested too deeply (at most {MAX_DEPTH} levels)")])
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            _check_scalar(key, path)
            stack.append((item, [*path, str(key)], outer | {id(value)}))


def check_expanded_size(doc: Any) -> None:
    """`SpecError` for a document that expands past `MAX_VALUES` values or
    `MAX_TEXT_BYTES` of text. Linear in the document as parsed: each value
    shared through an alias is sized once (call `check_document` first, which
    refuses cycles)."""
    sizes: dict[int, tuple[int, int]] = {}  # id(container) -> (values, text bytes), expanded
    stack: list[tuple[Any, bool]] = [(doc, False)]
    while stack:
        value, children_done = stack.pop()
        if id(value) in sizes:
            continue
        items = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
        inner = [v for _, v in items if isinstance(v, dict | list) and id(v) not in sizes]
        if not children_done and inner:
            stack.append((value, True))
            stack.extend((v, False) for v in inner)
            continue
        count, text = 1, 0
        for key, item in items:
            text += len(key) if isinstance(key, str) else 0
            if isinstance(item, dict | list):
                n, b = sizes[id(item)]
            else:
                n, b = 1, len(item) if isinstance(item, str) else 0
            count, text = count + n, text + b
        if count > MAX_VALUES or text > MAX_TEXT_BYTES:
            raise SpecError([("", f"the document expands to more than {MAX_VALUES:,} values or "
                                  f"{MAX_TEXT_BYTES >> 20} MiB of text (each YAML alias repeats "
                                  "what it names); write it without nested aliases, or smaller")])
        sizes[id(value)] = (count, text)


def _check_scalar(value: Any, path: list[str]) -> None:
    where = ".".join(path)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise SpecError([(where, "holds a lone UTF-16 surrogate (an escape such as \\ud800), "
                                     "which UTF-8 cannot carry; write the character unescaped, or "
                                     "as an escaped pair in JSON")]) from None
    elif isinstance(value, int):  # bool too
        if value.bit_length() > MAX_INT_BITS:
            raise SpecError([(where, "is an integer too long to store")])
    elif not isinstance(value, float | datetime.date | None):
        raise SpecError([(where, f"is a YAML {type(value).__name__}; a job spec holds only mappings, "
                                 "lists, text, numbers, booleans, dates and null")])


# A job YAML together with the files its `extends:` chain names, as the web
# console uploads them: `{"main": NAME, "files": {NAME: text, ...}}`.
BUNDLE_TYPE = "application/vnd.kuangchao.bundle+json"
MAX_BUNDLE_FILES = 16


def parse_bundle(text: str) -> dict[str, Any]:
    """Resolve a bundle's `extends:` chain among its own files and return the
    merged document. The server reads no file: a parent is looked up by its
    file name among those uploaded (an upload carries no folders).

    Raises:
        SpecError: A malformed bundle, a parent that was not uploaded, a
            cycle, or any file `parse_spec_text` refuses (its name leads the path).
    """
    from pathlib import PurePosixPath

    from kuangchao.platform.spec.jobspec import deep_merge

    try:
        bundle = json.loads(text)
    except ValueError:
        bundle = None
    files = bundle.get("files") if isinstance(bundle, dict) else None
    if (not isinstance(files, dict) or not files or len(files) > MAX_BUNDLE_FILES
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
            or bundle.get("main") not in files):
        raise SpecError([("", f"a bundle is JSON {{\"main\": NAME, \"files\": {{NAME: YAML text}}}} "
                              f"with 1 to {MAX_BUNDLE_FILES} files, `main` among them")])

    def load(name: str, seen: tuple[str, ...]) -> dict[str, Any]:
        if name in seen:
            raise SpecError([("extends", f"cycle in extends chain: {' -> '.join((*seen, name))}")])
        if name not in files:
            raise SpecError([("extends", f"{seen[-1]} extends {name}, which was not uploaded "
                                         f"(uploaded: {', '.join(sorted(files))}); add it")])
        try:
            doc = parse_spec_text(files[name])
        except SpecError as exc:
            raise SpecError([(p, f"{name}: {m}") for p, m in exc.errors]) from None
        parent = doc.pop("extends", None)
        if parent is None:
            return doc
        if not isinstance(parent, str):
            raise SpecError([("extends", f"{name}: must be a file name, got {parent!r}")])
        return deep_merge(load(PurePosixPath(parent).name, (*seen, name)), doc)

    return load(bundle["main"], ())
