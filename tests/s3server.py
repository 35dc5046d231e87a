"""A real S3-compatible server for tests and benches: moto's standalone server
(`moto_server`) as a child process on a free port of 127.0.0.1.

    with S3Server() as s3:
        s3.create_bucket("ckpt")
        monkeypatch.setattr(os, "environ", {**os.environ, **s3.admin_env()})
        ...
        with s3.frozen():   # SIGSTOP: the store stops answering, connections hang
            ...

With `enforce_auth=True` the server checks every request's signature and IAM
policy, as AWS does: only an admin IAM user (`*` on `*`, created at start) and
the principals it makes may act, and `admin_env()` holds that user's keys. What
moto's policy evaluation leaves out (session policies of AssumeRole, conditions
other than StringEquals) it does not enforce.

How auth is switched on. moto counts requests that reach its authorisation hook
(one per S3 request or per call of another service; its own `/moto-api/` routes
do not count) in a class attribute, and enforces IAM once that count reaches the
setting `INITIAL_NO_AUTH_ACTION_COUNT` (environment variable, default infinity).
Starting with a small count would tie the bootstrap to an exact number of
requests: a retried request (botocore retries a reset connection), or a helper
that makes one call more, would leave auth off or lock the admin out. So the
server starts with the default (never enforce), the bootstrap makes its IAM
calls, and then a POST of `0` to `/moto-api/reset-auth` (the route moto's own
`set_initial_no_auth_action_count` uses in server mode) sets the threshold to 0
and the count to 0: every later request is checked, however many the bootstrap
made.

Importable from the repository root as `tests.s3server` (tests/ is a package),
by tests and by bench/ scripts alike.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kuangchao.platform.runtime.procs import free_port

REGION = "us-east-1"
ADMIN_USER = "kc-test-admin"
ADMIN_POLICY = '{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"*","Resource":"*"}]}'
# moto accepts any key while auth is off; these are the conventional dummies.
OPEN_KEY = OPEN_SECRET = "testing"
# The operator's environment variables that would override admin_env()'s, or add
# to it, in botocore's credential chain: a test that applies admin_env() drops these.
AWS_VARS_TO_CLEAR = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
                     "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL_STS", "AWS_ENDPOINT_URL_IAM",
                     "AWS_DEFAULT_REGION", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE")
START_DEADLINE_S = 90.0  # moto imports a lot; a loaded CI machine takes tens of seconds
PORT_TRIES = 5


class S3Server:
    """moto's S3 (and IAM, STS) server in a child process; a context manager.

    Attributes:
        endpoint: `http://127.0.0.1:PORT`.
        pid: The server's process id (it leads a process group of its own).
        log_path: Where the server's stdout and stderr go.
    """

    def __init__(self, enforce_auth: bool = False, start_deadline_s: float = START_DEADLINE_S) -> None:
        self.enforce_auth = enforce_auth
        self.start_deadline_s = start_deadline_s
        self.endpoint = ""
        self.port = 0
        self.pid = 0
        self._proc: subprocess.Popen | None = None
        self._frozen = False
        self._key, self._secret = OPEN_KEY, OPEN_SECRET
        self._log_dir = Path(tempfile.mkdtemp(prefix="kc-s3server-"))
        self.log_path = self._log_dir / "moto.log"

    # -- lifecycle ------------------------------------------------------------------

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> S3Server:
        """Start the server and wait until it answers (and, with `enforce_auth`, bootstrap).

        Raises:
            RuntimeError: It exited or did not answer within `start_deadline_s`; the
                message holds the tail of its log.
        """
        try:
            for _ in range(PORT_TRIES):  # another server may take the port before moto binds it
                if self._launch(free_port()):
                    break
            else:
                raise RuntimeError(f"moto_server would not start on {PORT_TRIES} ports:\n{self.log_tail()}")
            if self.enforce_auth:
                self._bootstrap_auth()
        except BaseException:
            self.stop()
            raise
        return self

    def _command(self) -> list[str]:
        script = Path(sys.executable).parent / "moto_server"
        if script.is_file():
            return [str(script)]
        found = shutil.which("moto_server")
        return [found] if found else [sys.executable, "-m", "moto.server"]

    def _launch(self, port: int) -> bool:
        """Start on `port`; True once it answers, False when it exited (port taken)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MOTO_"))}
        env.pop("INITIAL_NO_AUTH_ACTION_COUNT", None)  # auth starts off; see the module doc
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [*self._command(), "-H", "127.0.0.1", "-p", str(port)], stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.port, self.pid = port, self._proc.pid
        self.endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.start_deadline_s
        while time.monotonic() < deadline:
            if self._answers():
                return True
            try:  # the pause between polls, which also notices an early exit
                self._proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                continue
            if "address already in use" in self.log_tail().lower():
                return False
            raise RuntimeError(f"moto_server exited with {self._proc.returncode}:\n{self.log_tail()}")
        raise RuntimeError(f"moto_server did not answer on {self.endpoint} within "
                           f"{self.start_deadline_s:.0f} s:\n{self.log_tail()}")

    def _answers(self) -> bool:
        """Whether our moto answers: it says "Need to POST to reset Moto Auth" (400) to a
        GET of that route; another server that took the port says something else."""
        try:
            with urllib.request.urlopen(f"{self.endpoint}/moto-api/reset-auth", timeout=2) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            body = exc.read()
        except (urllib.error.URLError, OSError):
            return False
        return b"Moto" in body and self._proc is not None and self._proc.poll() is None

    def _bootstrap_auth(self) -> None:
        iam = self.client("iam")
        iam.create_user(UserName=ADMIN_USER)
        iam.put_user_policy(UserName=ADMIN_USER, PolicyName="admin", PolicyDocument=ADMIN_POLICY)
        key = iam.create_access_key(UserName=ADMIN_USER)["AccessKey"]
        self._set_auth_threshold(0)
        self._key, self._secret = key["AccessKeyId"], key["SecretAccessKey"]
        # Proof that auth is on: the dummy keys are refused, the admin's accepted.
        from botocore.exceptions import ClientError

        try:
            self.client("s3", key=OPEN_KEY, secret=OPEN_SECRET).list_buckets()
        except ClientError:
            pass
        else:
            raise RuntimeError("moto_server accepted unknown keys after auth was switched on")
        self.client("s3").list_buckets()

    def _set_auth_threshold(self, count: int) -> None:
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", data=str(count).encode(),
                                     method="POST", headers={"Content-Type": "text/plain"})
        # (urllib's default form type would have moto's Flask eat the body as a form)
        with urllib.request.urlopen(req, timeout=10) as resp:
            if resp.status != 200:
                raise RuntimeError(f"moto refused reset-auth: {resp.status} {resp.read()!r}")

    def stop(self) -> None:
        """Kill the server (thawing it first) and remove its log; safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is None:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        self._frozen = False
        shutil.rmtree(self._log_dir, ignore_errors=True)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # -- freezing ---------------------------------------------------------------------

    def freeze(self) -> None:
        """SIGSTOP the server: it accepts connections (the kernel does) but never answers."""
        if self._proc is None:
            raise RuntimeError("the server is not running")
        os.killpg(self._proc.pid, signal.SIGSTOP)
        self._frozen = True

    def thaw(self) -> None:
        if self._proc is not None and self._frozen:
            os.killpg(self._proc.pid, signal.SIGCONT)
        self._frozen = False

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        self.freeze()
        try:
            yield
        finally:
            self.thaw()

    # -- clients -------------------------------------------------------------------------

    def admin_env(self) -> dict[str, str]:
        """The operator's environment for this server: the admin's keys, endpoint, region."""
        return {"AWS_ACCESS_KEY_ID": self._key, "AWS_SECRET_ACCESS_KEY": self._secret,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": REGION}

    def use_admin_env(self, monkeypatch: Any) -> None:
        """Apply `admin_env()` with pytest's monkeypatch, dropping what would override it
        (and the files of ~/.aws, which botocore would read too)."""
        for name in AWS_VARS_TO_CLEAR:
            monkeypatch.delenv(name, raising=False)
        for name in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
            monkeypatch.setenv(name, os.devnull)
        for name, value in self.admin_env().items():
            monkeypatch.setenv(name, value)

    def client(self, service: str = "s3", key: str | None = None, secret: str | None = None,
               token: str | None = None, timeout_s: float = 30, attempts: int = 2) -> Any:
        """A boto3 client of this server (the admin's keys unless others are given), waiting
        `timeout_s` for a connection and for each response, `attempts` times in all."""
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            service, endpoint_url=self.endpoint, region_name=REGION,
            aws_access_key_id=key or self._key, aws_secret_access_key=secret or self._secret,
            aws_session_token=token,
            config=Config(connect_timeout=min(timeout_s, 5), read_timeout=timeout_s,
                          retries={"max_attempts": attempts}))

    def create_bucket(self, name: str) -> None:
        self.client("s3").create_bucket(Bucket=name)
