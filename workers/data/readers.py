"""The user's documents, read for the tokenizer: text, jsonl, parquet and chat files.

``list_sources`` turns ``data.path`` (a file, a folder or a glob) into the sorted files to
read and the folder the tokenized cache goes in (``tokenized.py``); ``Documents`` yields
the documents of those files one by one, each with where it came from (``file:line``),
and stops once ``data.max_bytes`` of text were read. A text document is a whole file, a
jsonl or parquet document the ``data.field`` of a row, a chat document a row's
``messages``. Errors in the user's files are ``DataError``s that name the file and row.
"""

from __future__ import annotations

import codecs
import glob
import itertools
import json
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kuangchao.workers.data.corpus import _check_inside, permit_read
from kuangchao.workers.errors import DataError

FORMATS = ("text", "jsonl", "parquet", "chat")
# The files a folder or glob contributes, by format (text: every regular file).
EXTENSIONS: dict[str, tuple[str, ...]] = {
    "text": (), "jsonl": (".jsonl", ".json"), "chat": (".jsonl", ".json"), "parquet": (".parquet",),
}
# The tokenized cache's folder beside the data; hidden, so never read as data.
CACHE_FOLDER = ".kc-tokenized"
PARQUET_BATCH = 1000
_MAGIC = frozenset("*?[")
_CHAT_SHAPE = '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'

# A chat document: the row's messages, each {role, content, ...}.
Document = str | list[dict]


@dataclass(frozen=True)
class Sources:
    """The files ``data.path`` names, in reading order, and the folder the cache goes in."""

    base: Path
    files: tuple[Path, ...]

    def stamp(self) -> list[list]:
        """(name relative to ``base``, size, mtime_ns) of each file: what the cache key
        holds of the data, so an edited, added or removed file makes a new key."""
        out = []
        for file in self.files:
            try:
                st = file.stat()
            except OSError as exc:
                raise DataError(f"data.path: cannot read '{file}': {exc}") from exc
            out.append([os.path.relpath(file, self.base), st.st_size, st.st_mtime_ns])
        return out


def has_magic(path: str) -> bool:
    return any(c in _MAGIC for c in path)


def infer_format(path: str) -> str:
    """The format of ``data.path`` when ``data.format`` is not set: jsonl for .jsonl/.json,
    parquet for .parquet (for a folder: when all its files are), else text."""
    p = Path(path)
    if not has_magic(path) and p.is_dir():
        suffixes = {f.suffix.lower() for f in _walk(p, "text")}
    else:
        suffixes = {p.suffix.lower()}
    if suffixes and suffixes <= set(EXTENSIONS["jsonl"]):
        return "jsonl"
    if suffixes == {".parquet"}:
        return "parquet"
    return "text"


def list_sources(path: str, fmt: str, roots: tuple[str, ...] | None) -> Sources:
    """The files to read for ``data.path``, sorted; each checked against ``roots``.

    A file is read as it is; a folder gives its files of the format's extensions
    (every file for text), recursively, hidden ones skipped; a glob its matches
    (folders among them expanded the same way). The cache goes beside a file, inside
    a folder, and in the glob's leading folder.

    Raises:
        DataError: When a path leads outside ``roots``, or nothing is there to read.
    """
    kind = "/".join(EXTENSIONS[fmt]) or "regular"
    if has_magic(path):
        base = _glob_base(path)
        files: list[Path] = []
        for match in sorted(glob.glob(path, recursive=True)):
            m = Path(match)
            if roots is not None:
                _check_inside(m, roots)
            if m.is_dir():
                files += _walk(m, fmt)
            elif m.is_file():
                files.append(m)
        files = list(dict.fromkeys(files))
        if not files:
            raise DataError(f"data.path: the pattern '{path}' matches no {kind} files on this node "
                            f"({socket.gethostname()}); fix the pattern, or put the files there")
    else:
        p = Path(path)
        if roots is not None:
            _check_inside(p, roots)
        if not p.exists():
            raise DataError(f"data.path: '{path}' does not exist on this node "
                            f"({socket.gethostname()}); put the data where every worker can read "
                            "it, or fix data.path")
        if p.is_dir():
            base, files = p, _walk(p, fmt)
            if not files:
                raise DataError(f"data.path: the folder '{path}' holds no {kind} files for "
                                f"data.format {fmt}; fix data.path or data.format")
        else:
            base, files = p.parent, [p]
    if roots is not None:
        for file in files:
            _check_inside(file, roots)
    return Sources(base, tuple(files))


def _glob_base(pattern: str) -> Path:
    """The folder before a glob's first wildcard ('/d/*.jsonl' -> '/d')."""
    lead = list(itertools.takewhile(lambda part: not has_magic(part), Path(pattern).parts))
    return Path(*lead) if lead else Path(".")


def _walk(folder: Path, fmt: str) -> list[Path]:
    exts = EXTENSIONS[fmt]
    out: list[Path] = []
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:  # a symlink loop
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith(".") or (exts and not name.lower().endswith(exts)):
                continue
            file = Path(dirpath, name)
            if file.is_file():
                out.append(file)
    return sorted(out, key=lambda f: f.relative_to(folder).parts)


def _utf8(text: str) -> tuple[str, bytes]:
    try:
        return text, text.encode()
    except UnicodeEncodeError:  # lone surrogates from JSON escapes
        raw = text.encode("utf-8", "replace")
        return raw.decode(), raw


def _decode(raw: bytes, final: bool) -> str:
    # Not final: a character cut in half at the byte budget is dropped, not replaced.
    return codecs.getincrementaldecoder("utf-8")("replace").decode(raw, final=final)


class Documents:
    """The documents of ``sources``, in order, until ``max_bytes`` of text were read.

    Iterating yields ``(document, where)``: a str (text, jsonl, parquet) or a chat row's
    messages, and ``file`` or ``file:line`` (``file row N`` for parquet). A text document
    that crosses the budget is cut there; a chat row is taken whole. ``bytes_read`` is the
    UTF-8 text read so far and ``limit_reached`` whether the budget stopped the reading.
    ``permit_read`` is asked before each file is opened.
    """

    def __init__(self, sources: Sources, fmt: str, field: str, max_bytes: int) -> None:
        self.sources, self.fmt, self.field, self.max_bytes = sources, fmt, field, max_bytes
        self.bytes_read = 0
        self.limit_reached = False

    def __iter__(self) -> Iterator[tuple[Document, str]]:
        read = {"text": self._text, "jsonl": self._jsonl, "chat": self._jsonl,
                "parquet": self._parquet}[self.fmt]
        for file in self.sources.files:
            if self._left() <= 0:
                return
            permit_read(str(file))
            try:
                yield from read(file)
            except OSError as exc:
                raise DataError(f"data.path: cannot read '{file}': {exc}") from exc

    def _left(self) -> int:
        left = self.max_bytes - self.bytes_read
        if left <= 0:
            self.limit_reached = True
        return left

    def _take(self, text: str) -> str:
        """``text``, cut to what is left of the budget, counted."""
        text, raw = _utf8(text)
        left = self._left()
        if len(raw) > left:
            text, raw = _decode(raw[:left], final=False), raw[:left]
        self.bytes_read += len(raw)
        return text

    def _text(self, file: Path) -> Iterator[tuple[Document, str]]:
        left = self._left()
        with open(file, "rb") as f:
            raw = f.read(left)
        self.bytes_read += len(raw)
        yield _decode(raw, final=len(raw) < left), str(file)

    def _jsonl(self, file: Path) -> Iterator[tuple[Document, str]]:
        with open(file, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if self._left() <= 0:
                    return
                where = f"{file}:{lineno}"
                row = _json_row(line, where)
                if self.fmt == "chat":
                    messages = _messages(row, where)
                    self.bytes_read += sum(len(_utf8(m["content"])[1]) for m in messages)
                    yield messages, where
                else:
                    yield self._take(_field(row, self.field, where)), where

    def _parquet(self, file: Path) -> Iterator[tuple[Document, str]]:
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise DataError("data.format: parquet needs pyarrow on the workers; install "
                            "kuangchao[hf] (pip install 'kuangchao[hf]')") from exc
        try:
            pf = pq.ParquetFile(file)
        except (pa.ArrowException, ValueError) as exc:
            raise DataError(f"data.path: '{file}' is not a readable parquet file ({exc}); "
                            "fix the file, or set data.format to its format") from exc
        with pf:
            schema = pf.schema_arrow
            if self.field not in schema.names:
                raise DataError(f"data.field: '{file}' has no column '{self.field}' (its columns: "
                                f"{', '.join(schema.names) or 'none'}); set data.field to the "
                                "column that holds the text")
            kind = schema.field(self.field).type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                    or pa.types.is_string_view(kind)):
                raise DataError(f"data.field: column '{self.field}' of '{file}' holds {kind}, not "
                                "text; set data.field to a string column")
            row = 0
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH, columns=[self.field]):
                for value in batch.column(0).to_pylist():
                    row += 1
                    if self._left() <= 0:
                        return
                    if value is None:
                        raise DataError(f"data.field: '{file}' row {row} has no '{self.field}' "
                                        "value (null); drop the row or fill in its text")
                    yield self._take(value), f"{file} row {row}"


def _json_row(line: bytes, where: str) -> dict:
    try:
        row = json.loads(line)
    except ValueError as exc:
        raise DataError(f"data.path: {where} is not valid JSON ({exc}); write one JSON object "
                        "per line (JSON Lines)") from exc
    if not isinstance(row, dict):
        raise DataError(f"data.path: {where} is a JSON {type(row).__name__}, not an object; "
                        "write one JSON object per line (JSON Lines)")
    return row


def _field(row: dict, field: str, where: str) -> str:
    if field not in row:
        raise DataError(f"data.field: {where} has no '{field}' field (its keys: "
                        f"{', '.join(map(str, row)) or 'none'}); set data.field to the key that "
                        "holds the text")
    value = row[field]
    if not isinstance(value, str):
        raise DataError(f"data.field: '{field}' of {where} is a {type(value).__name__}, not a "
                        "string; set data.field to the key that holds the text")
    return value


def _messages(row: dict, where: str) -> list[dict]:
    if "messages" not in row:
        raise DataError(f"data.format chat: {where} has no 'messages' (its keys: "
                        f"{', '.join(map(str, row)) or 'none'}); write each line as {_CHAT_SHAPE}, "
                        "or set data.format to jsonl for rows of plain text")
    messages = row["messages"]
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                       and isinstance(m.get("content"), str) for m in messages)):
        raise DataError(f"data.format chat: 'messages' of {where} is not a non-empty list of "
                        f"{{role, content}} objects with string values; write each line as "
                        f"{_CHAT_SHAPE}")
    return messages
