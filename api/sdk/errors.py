"""The SDK's one exception: the API refused, or could not be reached. Picklable.
(`tests/unit/test_errors.py` round-trips it)."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """The API answered with an error, or could not be reached.

    Attributes:
        status: HTTP status, or 0 when the server could not be reached.
        detail: The server's `detail` (a string, or a list of field errors).
    """

    def __init__(self, status: int, detail: Any) -> None:
        self.status, self.detail = status, detail
        super().__init__(self.describe())

    def __reduce__(self):
        return (self.__class__, (self.status, self.detail))

    def describe(self) -> str:
        if isinstance(self.detail, list):
            return "\n".join(f"{d.get('field') or '.'.join(map(str, d.get('loc', [])))}: {d['msg']}"
                             for d in self.detail)
        return str(self.detail)

    @property
    def is_user_error(self) -> bool:
        return self.status == 0 or 400 <= self.status < 500 or self.status == 503
