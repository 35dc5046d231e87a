"""What every `kc` command module shares: the API client, `fail`, `--json`."""

from __future__ import annotations

from typing import Annotated, Any, NoReturn

import typer

from kuangchao.api.cli.render import terminal_safe
from kuangchao.api.sdk.client import ApiError, Client
from kuangchao.platform.settings import Settings, credentials_file

Json = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


def fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {terminal_safe(message)}", err=True)
    raise typer.Exit(code)


def client() -> Client:
    s = Settings.from_env()
    return Client(s.api_url, s.api_key)


def call(fn, *args: Any, **kw: Any) -> Any:
    """`fn(*args)` against the API; an API error exits 2 (bad input, refused) or 1."""
    try:
        return fn(*args, **kw)
    except ApiError as exc:
        message = exc.describe()
        if exc.status == 401:
            message += (f"\nkc sends KC_API_KEY, else the key in {credentials_file()} "
                        "(written by `kc up`); ask an admin for a key with `kc admin key create`")
        fail(message, 2 if exc.is_user_error else 1)
