"""`python -m kuangchao.api.server`: run the REST API with uvicorn."""

from __future__ import annotations

import argparse

import uvicorn


def main() -> None:
    parser = argparse.ArgumentParser(description="kuangchao REST API")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run("kuangchao.api.app:app", host=args.host, port=args.port, log_level="info",
                access_log=False)


if __name__ == "__main__":
    main()
