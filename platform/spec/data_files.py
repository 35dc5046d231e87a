"""A first look at a job's data files at submission: the named field, the chat rows.

The ranks read every row (workers/data/readers.py) and refuse a bad one with its
file and line; this looks only at the first file's first row, so that the common
mistakes (a field that is not in the rows, chat data without `messages`) come
back as a 422 at submission instead of a job that fails once it has GPUs. A path
the API server cannot see is left to the ranks (`KC_MODEL_FOLDER_CHECK=start`
skips this look too), and so is an object-store URL: submission asks no store
(the ranks copy it to their node and report a bad row there). No torch;
pyarrow only for a parquet file.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Any

from kuangchao.platform.storage.urls import is_url

SUFFIXES = {"jsonl": (".jsonl", ".json"), "chat": (".jsonl", ".json"), "parquet": (".parquet",)}
FIRST_LINE_LIMIT = 16 << 20


def _first_file(path: str, fmt: str) -> Path | None:
    if any(c in path for c in "*?["):
        names = sorted(glob.glob(os.path.expanduser(path)))
    elif Path(path).expanduser().is_dir():
        names = sorted(str(p) for p in Path(path).expanduser().rglob("*")
                       if p.is_file() and not any(part.startswith(".") for part in p.parts)
                       and p.suffix in SUFFIXES[fmt])
    else:
        names = [os.path.expanduser(path)]
    return Path(names[0]) if names and Path(names[0]).is_file() else None


def _first_row(file: Path, fmt: str) -> tuple[Any, str] | None:
    """(the first row, where it is), or None when there is nothing to look at."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            return {name: None for name in pq.read_schema(file).names}, f"{file}"
        except Exception:  # not readable here: the ranks say what is wrong with it
            return None
    try:
        with file.open("rb") as fh:
            for n, line in enumerate(fh, 1):
                if len(line) > FIRST_LINE_LIMIT:
                    return None
                if line.strip():
                    return json.loads(line), f"{file}:{n}"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # the ranks report it with its line
    return None


def data_file_errors(spec: Any) -> list[tuple[str, str]]:
    """What the first row of the job's data says against `data.field` or the chat format."""
    d = spec.data
    fmt = d.format
    if d.path is None or fmt not in SUFFIXES or is_url(d.path):
        return []
    file = _first_file(d.path, fmt)
    if file is None:
        return []
    found = _first_row(file, fmt)
    if found is None:
        return []
    row, where = found
    if not isinstance(row, dict):
        return [("data.path", f"{where}: a {fmt} row must be a JSON object, got {type(row).__name__}")]
    if fmt == "chat":
        messages = row.get("messages")
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            keys = ", ".join(sorted(row)) or "no keys"
            return [("data.format", f"{where}: a chat row needs `messages`, a list of "
                                    f"{{role, content}} strings; it has {keys}")]
        return []
    if d.field not in row:
        return [("data.field", f"{where}: the rows have no {d.field!r}; they have "
                               f"{', '.join(sorted(map(str, row))) or 'no keys'}: set data.field to one")]
    return []
