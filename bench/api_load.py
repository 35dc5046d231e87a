"""Load generation for bench/api.py, and its trivial baseline app.

* `app`: the baseline, a FastAPI app with one trivial route (`POST /ping`
  reads the body and answers `{"ok": true}`); `python bench/api_load.py
  --port P` serves it through kuangchao's own `api/server/serve.py` `main()` with
  only the app swapped, so both servers run with identical uvicorn settings;
* `Conn`: a minimal HTTP/1.1 keep-alive client on a raw socket. Requests are
  encoded once and replayed; a response is read by its `Content-Length`. A
  request costs the client some tens of microseconds, against several hundred
  for httpx, so on a 2-core machine the client does not set the pace of the
  baseline server it is measuring;
* `closed_loop()`: N connections, each sending its next request as soon as
  the previous answer is in (peak throughput);
* `open_loop()`: requests at fixed intended start times (a constant rate); a
  request that waits for a free connection has its latency measured from its
  intended start, so a slow answer that delays the next sends counts against
  the server (no coordinated omission).
"""

from __future__ import annotations

import itertools
import math
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request

app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)


@app.post("/ping")
async def ping(request: Request) -> dict[str, bool]:
    await request.body()
    return {"ok": True}


# -- the client ----------------------------------------------------------------

def encode_request(method: str, path: str, port: int, headers: dict[str, str] | None = None,
                   body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Accept: */*"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class Conn:
    """One keep-alive connection; `send(raw)` returns (status, body)."""

    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 30.0) -> None:
        self.addr, self.timeout = (host, port), timeout
        self.sock: socket.socket | None = None
        self.buf = b""

    def _connect(self) -> socket.socket:
        s = socket.create_connection(self.addr, timeout=self.timeout)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self.buf = s, b""
        return s

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def send(self, raw: bytes) -> tuple[int, bytes]:
        s = self.sock or self._connect()
        s.sendall(raw)
        buf = self.buf
        while (end := buf.find(b"\r\n\r\n")) < 0:
            chunk = s.recv(65536)
            if not chunk:
                self.close()
                raise ConnectionError("server closed the connection")
            buf += chunk
        head = buf[:end].decode("latin-1")
        status = int(head[9:12])
        length, close = 0, False
        for line in head.split("\r\n")[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "connection" and value.strip().lower() == "close":
                close = True
            elif name == "transfer-encoding":
                raise ValueError("chunked responses are not supported by this client")
        need = end + 4 + length
        while len(buf) < need:
            chunk = s.recv(65536)
            if not chunk:
                self.close()
                raise ConnectionError("server closed the connection mid-body")
            buf += chunk
        body, self.buf = buf[end + 4:need], buf[need:]
        if close:
            self.close()
        return status, body


# -- load patterns -------------------------------------------------------------

@dataclass
class Result:
    rps: float  # completed requests per second in the measured window
    latencies_s: list[float] = field(default_factory=list)
    errors: int = 0  # transport errors and unexpected statuses
    sample_error: str = ""
    late_s: float = 0.0  # open loop: the latest a request was sent after its intended time

    def percentile(self, q: float) -> float:
        """Nearest-rank percentile of the latencies, in seconds."""
        xs = sorted(self.latencies_s)
        if not xs:
            return float("nan")
        return xs[max(0, math.ceil(q / 100 * len(xs)) - 1)]


def closed_loop(port: int, raw: bytes, expect: int, concurrency: int, seconds: float,
                warmup_s: float = 0.3) -> Result:
    """`concurrency` connections back to back for `warmup_s + seconds`; the
    rate counts the requests completed after the warm-up."""
    conns = [Conn(port) for _ in range(concurrency)]
    for c in conns:
        c._connect()
    start = threading.Barrier(concurrency + 1)
    per_thread: list[list[float]] = [[] for _ in range(concurrency)]
    errors: list[str] = []
    t = {"begin": 0.0, "end": 0.0}

    def worker(i: int) -> None:
        conn, done = conns[i], per_thread[i]
        start.wait()
        end = t["end"]
        while True:
            t0 = time.perf_counter()
            if t0 >= end:
                break
            ok = _exchange(conn, raw, expect, errors)
            t1 = time.perf_counter()
            if ok and t1 <= end:
                done.append(t0)
                done.append(t1)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for th in threads:
        th.start()
    t["begin"] = time.perf_counter()
    t["end"] = t["begin"] + warmup_s + seconds
    start.wait()
    for th in threads:
        th.join()
    for c in conns:
        c.close()
    measured_from = t["begin"] + warmup_s
    lat, n = [], 0
    for done in per_thread:
        for t0, t1 in zip(done[::2], done[1::2], strict=True):
            if t1 >= measured_from:
                n += 1
                lat.append(t1 - t0)
    return Result(rps=n / seconds, latencies_s=lat, errors=len(errors),
                  sample_error=errors[0] if errors else "")


def _exchange(conn: Conn, raw: bytes, expect: int, errors: list[str]) -> bool:
    """One request and its answer; False, with the reason in `errors`, when it
    failed or was answered with another status."""
    try:
        status, body = conn.send(raw)
    except (OSError, ValueError) as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
        conn.close()
        return False
    if status != expect:
        errors.append(f"HTTP {status}: {body[:300]!r}")
        return False
    return True


def open_loop(port: int, raw: bytes, expect: int, rate: float, seconds: float,
              connections: int = 16, warmup_s: float = 0.5) -> Result:
    """Requests intended at `t0 + i / rate` for `warmup_s + seconds`, sent over
    a pool of `connections`. A request's latency runs to its answer from its
    intended start when it had to wait for a free connection (the server was
    behind), else from when it was sent (the client's sleep overshooting is
    not the server's). Requests intended during the warm-up are not counted."""
    conns = [Conn(port) for _ in range(connections)]
    for c in conns:
        c._connect()
    ticket = itertools.count()
    start = threading.Barrier(connections + 1)
    lat: list[float] = []
    errors: list[str] = []
    late = [0.0]
    t = {"begin": 0.0}
    total = int((warmup_s + seconds) * rate)
    skip = int(warmup_s * rate)

    def worker(i: int) -> None:
        conn = conns[i]
        start.wait()
        begin = t["begin"]
        while (k := next(ticket)) < total:
            due = begin + k / rate
            wait = due - time.perf_counter()
            if wait > 0:
                # On time: the clock starts when the request goes out, so that
                # the client's own oversleep is not billed to the server.
                time.sleep(wait)
                due = time.perf_counter()
            else:  # every connection was busy: the wait counts
                late[0] = max(late[0], -wait)
            ok = _exchange(conn, raw, expect, errors)
            done = time.perf_counter()
            if ok and k >= skip:
                lat.append(done - due)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(connections)]
    for th in threads:
        th.start()
    t["begin"] = time.perf_counter() + 0.05
    start.wait()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t["begin"]
    for c in conns:
        c.close()
    return Result(rps=(total - skip) / max(1e-9, elapsed - warmup_s), latencies_s=lat,
                  errors=len(errors), sample_error=errors[0] if errors else "", late_s=late[0])


# -- serving the baseline --------------------------------------------------------

def serve_baseline() -> None:
    """Run kuangchao's API server entry point with this module's `app` in place of
    kuangchao's, so that every uvicorn setting (host, port, log level, access
    log, loop, workers, the frozen heap) is the one `python -m kuangchao.api.server` uses."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from kuangchao.api.server import serve as server
    server.main(app)


if __name__ == "__main__":
    serve_baseline()
