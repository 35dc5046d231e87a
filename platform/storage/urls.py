"""Object-store URLs (`s3://bucket/prefix`, any fsspec URL) as checkpoint and data
locations: telling them from paths, taking them apart, and the prefix rules the
admission check and the capability tokens apply to them.

Pure logic: no fsspec, no network. Whether a scheme has an implementation
installed, and whether its bucket exists, is objects.py's to say.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

# `scheme://`: RFC 3986's scheme grammar. A Windows drive (`C:\`) or a relative
# path with a colon in it (`runs/a:b`) is not a URL.
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.S)
# Schemes that name this machine's own files: a checkpoint there is a path.
LOCAL_SCHEMES = frozenset({"file", "local"})


def is_url(location: str) -> bool:
    """Whether `location` is a URL of some remote store rather than a local path."""
    m = _URL.match(location or "")
    return bool(m) and m.group(1).lower() not in LOCAL_SCHEMES


@dataclass(frozen=True)
class ObjectUrl:
    """`scheme://bucket/key`, normalised: no empty, `.` or `..` segment, no trailing `/`."""

    scheme: str
    bucket: str
    key: str = ""

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}" + (f"/{self.key}" if self.key else "")

    @property
    def path(self) -> str:
        """`bucket/key`: how fsspec names the object (no scheme)."""
        return f"{self.bucket}/{self.key}" if self.key else self.bucket

    def join(self, *parts: str) -> ObjectUrl:
        """This URL with `parts` appended; each part must be plain (see `check_part`)."""
        for part in parts:
            check_part(part)
        key = "/".join(p for p in (self.key, *parts) if p)
        return ObjectUrl(self.scheme, self.bucket, key)

    def contains(self, other: ObjectUrl) -> bool:
        """Whether `other` is this URL or lies beneath it."""
        if (other.scheme, other.bucket) != (self.scheme, self.bucket):
            return False
        return not self.key or other.key == self.key or other.key.startswith(self.key + "/")


def check_part(part: str) -> None:
    """Refuse a key segment that would leave its prefix or name nothing."""
    if not part or part in (".", "..") or "/" in part or "\0" in part:
        raise ValueError(f"{part!r} is not a plain object-key segment")


def parse(url: str) -> ObjectUrl:
    """`url` taken apart and normalised.

    Raises:
        ValueError: Not a URL, no bucket, or a key with `.`/`..`/empty segments
            (object stores keep `a/../b` as a literal key; a prefix check on it
            would be fooled), with a message saying which.
    """
    m = _URL.match(url or "")
    if not m or m.group(1).lower() in LOCAL_SCHEMES:
        raise ValueError(f"{url!r} is not an object-store URL (scheme://bucket/prefix)")
    scheme, rest = m.group(1).lower(), m.group(2)
    if any(c in rest for c in "?#\0\\"):
        raise ValueError(f"{url!r}: an object-store URL takes no query, fragment, backslash "
                         "or NUL; name the bucket and prefix only")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket (scheme://bucket/prefix)")
    segments = key.rstrip("/").split("/") if key.rstrip("/") else []
    bad = next((s for s in segments if s in ("", ".", "..")), None)
    if bad is not None:
        raise ValueError(f"{url!r} has an empty, '.' or '..' segment in its key; write the "
                         "prefix plainly (s3://bucket/a/b)")
    return ObjectUrl(scheme, bucket, "/".join(segments))


def under_prefixes(url: str, prefixes: tuple[str, ...]) -> bool:
    """Whether `url` is one of `prefixes` (URLs) or lies beneath one."""
    try:
        target = parse(url)
    except ValueError:
        return False
    for prefix in prefixes:
        try:
            if parse(prefix).contains(target):
                return True
        except ValueError:
            continue
    return False


def step_key(job_url: ObjectUrl, name: str) -> ObjectUrl:
    """The object of file `name` (plain) inside a job's checkpoint prefix."""
    return job_url.join(name)


def relative(base: ObjectUrl, target: ObjectUrl) -> str:
    """`target`'s key relative to `base` (which must contain it): `a/b`."""
    if not base.contains(target):
        raise ValueError(f"{target} is not inside {base}")
    return posixpath.relpath(target.key or ".", base.key or ".") if base.key else target.key
