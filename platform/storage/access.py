"""Which credentials this process uses for object stores.

A rank sets its job's scoped credentials once, from its grant
(`use_job_credentials`); from then on every store it opens (checkpoints,
profiles, data) uses those and never its node's environment. A process that
set none (the API, the controller, `kc`) is the operator's: it uses the
standard environment.

Also where this node keeps its local copies (`node_dir`): a folder of its own
when the local cluster gives each node a private one (`KC_NODE_DIR`), else
under `$KC_HOME`.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from kuangchao.platform.errors import StorageError
from kuangchao.platform.settings import kc_home
from kuangchao.platform.storage.objects import StoreCredentials, filesystem

_lock = threading.Lock()
_job_credentials: StoreCredentials | None = None
_is_rank = False


def use_job_credentials(credentials: StoreCredentials | None) -> None:
    """From now on, open stores with `credentials` only (a rank; None: no store access at all)."""
    global _job_credentials, _is_rank
    with _lock:
        _job_credentials, _is_rank = credentials, True


def forget_job_credentials() -> None:
    """Back to the operator's environment (tests, tools)."""
    global _job_credentials, _is_rank
    with _lock:
        _job_credentials, _is_rank = None, False


def job_credentials() -> StoreCredentials | None:
    return _job_credentials


_opened: dict[tuple[str, StoreCredentials | None], Any] = {}


def open_filesystem(scheme: str) -> Any:
    """A filesystem for `scheme` with this process's credentials (see the module doc).
    A rank's is kept per scheme and credentials, so its connections are reused; the
    operator's is made afresh, as its environment says now.

    Raises:
        StorageError: A rank whose grant holds no object-store credentials.
    """
    with _lock:
        creds, is_rank = _job_credentials, _is_rank
        fs = _opened.get((scheme, creds))
    if is_rank and creds is None:
        raise StorageError("this job was granted no object-store credentials; its checkpoint.path "
                           "or data.path is not an object-store URL, or the token authority "
                           "could not scope credentials (see the controller's log)")
    if fs is None:
        fs = filesystem(scheme, creds)
        if creds is not None:
            with _lock:
                if len(_opened) > 8:  # filesystems of credentials renewed since
                    _opened.clear()
                _opened[(scheme, creds)] = fs
    return fs


def apply_operator_env(env: dict[str, str] | None) -> None:
    """Take the operator's object-store settings into this process's environment.

    For the control plane's actors (the token authority, the controllers) on
    the head, whose raylet's environment holds none of them; see
    `Settings.object_store_env`.
    """
    for key, value in (env or {}).items():
        os.environ[key] = value  # over the raylet's /dev/null credential files: these win


def node_dir() -> Path:
    """This node's own folder for local copies (checkpoint staging, data cache)."""
    own = os.environ.get("KC_NODE_DIR")
    return Path(own).expanduser() if own else kc_home() / "node"


def cache_dir(kind: str) -> Path:
    """`{node_dir}/cache/{kind}`: local copies of objects, safe to delete when idle."""
    return node_dir() / "cache" / kind
