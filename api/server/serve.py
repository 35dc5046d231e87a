"""`python -m kuangchao.api.server`: run the REST API with uvicorn."""

from __future__ import annotations

import argparse
import gc
from typing import Any

import uvicorn

from kuangchao.platform.observability.logjson import use_json_logs


def main(app: Any = None) -> None:
    """Serve `app` (default: kuangchao's; bench/api.py serves its baseline through here too,
    so that both run with the same settings)."""
    parser = argparse.ArgumentParser(description="kuangchao REST API")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    from kuangchao.api.server.edge import max_body_bytes
    from kuangchao.platform.errors import KuangchaoError
    from kuangchao.platform.settings import Settings

    try:  # a bad setting stops the server here, with its message, not at the first request
        max_body_bytes()
        Settings.from_env()  # KC_REDIS_URL_FILE, when named, must be readable
    except KuangchaoError as exc:
        parser.exit(2, f"error: {exc.message}\n")
    if app is None:
        from kuangchao.api.server.app import app

    # What importing the app built (FastAPI, pydantic, Ray's protobufs) is never
    # garbage. Moved out of the collector's sight, full collections stop walking
    # it: without this, one takes 40-65 ms every second or two under load, and
    # sets the tail latency (bench/api.py).
    gc.collect()
    gc.freeze()
    use_json_logs("api")
    # log_config=None: uvicorn's own records go through the JSON handler too.
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", access_log=False,
                log_config=None)


if __name__ == "__main__":
    main()
