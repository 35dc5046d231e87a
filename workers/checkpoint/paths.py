"""Following paths into a job's checkpoint folder without being led out of it.

A job's ranks run the job's code, and they write its checkpoint folder
(`{checkpoint.path}/{job_id}`, the profiles beneath it included). Whatever
trusted process reads there afterwards, the controller, the API server or an
operator's `kc checkpoint`, must not follow a symlink the job planted to
another job's folder or to the process's own secrets. Checks on the path as
written (the API's roots, the token's prefix) cannot see one, so these resolve
the symlinks (`os.path.realpath`; of a path not there yet, as far as it exists)
and compare where the path really leads.

The job's folder is anchored on its parent resolved plus the job's own name:
a job folder that is itself a symlink leads nowhere inside it.

Torch-free: the controller and the API server import it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

from kuangchao.platform.protocol.checkpoint import MANIFEST, read_manifest
from kuangchao.platform.security.admission import under
from kuangchao.workers.errors import CheckpointError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def anchor(folder: str | os.PathLike[str]) -> str:
    """Where `folder` is, its parent's symlinks resolved but not its own: what a path
    must resolve inside to count as inside `folder`."""
    path = os.path.normpath(os.path.abspath(os.path.expanduser(os.fspath(folder))))
    parent, name = os.path.split(path)
    return os.path.join(os.path.realpath(parent), name) if name else path


def job_folder(root: str | os.PathLike[str], job_id: str) -> str:
    """`{root}/{job_id}` anchored: the root resolved, then the job's id."""
    return os.path.join(os.path.realpath(os.path.expanduser(os.fspath(root))), job_id)


def resolves_under(path: str | os.PathLike[str], roots: tuple[str, ...]) -> bool:
    """Whether `path`, symlinks resolved, lies in one of `roots` (resolved too)."""
    return under(os.path.realpath(os.path.expanduser(os.fspath(path))),
                 tuple(os.path.realpath(r) for r in roots))


def check_roots(root: str | os.PathLike[str], folder: str | os.PathLike[str],
                roots: tuple[str, ...]) -> None:
    """Refuse a job's checkpoint `folder` (under `checkpoint.path` `root`) that resolves
    outside every checkpoint root, before anything there is read or written.

    The API checked `checkpoint.path` against the roots as written; a symlink
    under a root can lead anywhere, so the worker checks where it leads, as
    workers/data/corpus.py does for `data.path`. Nothing said depends on
    whether anything exists there.

    Raises:
        CheckpointError: Naming the path as written, the roots and the setting.
    """
    if not resolves_under(folder, roots):
        raise CheckpointError(
            f"checkpoint.path: '{os.fspath(root)}' leads outside the folders jobs may write "
            f"checkpoints to on this node ({', '.join(roots)}); put it under one of them, or ask "
            "an operator to add a root (KC_CHECKPOINT_ROOTS)")


def leads_inside(path: str | os.PathLike[str], folder: str) -> bool:
    """Whether `path`, symlinks resolved, is `folder` (an `anchor`) or inside it."""
    return under(os.path.realpath(os.path.expanduser(os.fspath(path))),
                 (os.path.normpath(folder),))


def plain_name(name: str) -> bool:
    """A file name with no folder in it: not empty, no separator, not `.` or `..`."""
    return bool(name) and name not in (".", "..") and os.sep not in name and "\0" not in name \
        and (os.altsep is None or os.altsep not in name)


def open_inside(path: str | os.PathLike[str], folder: str) -> BinaryIO:
    """`path` open for reading if it resolves inside `folder` and is a regular file.

    The file itself is opened without following a symlink (O_NOFOLLOW), so one
    swapped in after the check is refused too.

    Raises:
        PermissionError: It leads outside `folder`, or is a symlink.
        FileNotFoundError: Nothing there; IsADirectoryError / OSError: not a file.
    """
    if not leads_inside(path, folder):
        raise PermissionError(f"{os.fspath(path)} leads outside {folder}")
    real = os.path.realpath(os.path.expanduser(os.fspath(path)))
    try:
        fd = os.open(real, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink swapped in since realpath
            raise PermissionError(f"{os.fspath(path)} is a symlink") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IsADirectoryError(f"{os.fspath(path)} is not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_step_folder(step: str | os.PathLike[str], folder: str) -> None:
    """Refuse a step folder a trusted process should not read: one that leads out of
    the job's `folder` (an `anchor`), holds a symlink, or whose manifest names a
    file outside it.

    A checkpoint never holds a symlink (DCP and the manager write plain files),
    so any is the job's code pointing elsewhere. A folder or manifest that is
    missing or unreadable passes: `verify` says what is wrong with it. Nothing
    said names where a symlink leads.

    Raises:
        CheckpointError: Saying which entry was refused.
    """
    step = Path(step)
    if not leads_inside(step, folder):
        raise CheckpointError(f"{step} leads outside the job's checkpoint folder {folder} "
                              "(a symlink); refusing to read it")
    real = os.path.realpath(step)
    try:
        entries = list(os.scandir(real))
    except OSError:
        return
    for entry in entries:
        if entry.is_symlink():
            raise CheckpointError(f"{step}: {entry.name!r} is a symlink, which no checkpoint "
                                  "holds; refusing to read the checkpoint")
    if not any(e.name == MANIFEST for e in entries):
        return
    try:
        names = list(read_manifest(step)["files"])
    except CheckpointError:
        return
    bad = next((n for n in names if not isinstance(n, str) or not plain_name(n)), None)
    if bad is not None:
        raise CheckpointError(f"{step}/{MANIFEST} lists {bad!r}, which is not a file of the "
                              "checkpoint folder; refusing to read it")
