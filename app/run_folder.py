"""A split server's run folder in the temp directory (its engines' sockets and boards, the
metrics files, the shared weights, the cores' lock), and the removal of folders that killed
servers left behind.

A supervisor that is killed (SIGKILL, the OOM killer) never runs its cleanup, and its folder
can hold a copy of the model's weights, on a tmpfs in memory. So every process of a server
holds a shared lock on a marker file in the folder for as long as it lives; the kernel drops
it however the process ends. A server starting up removes each folder whose marker nobody
holds any more: every process that used it has gone. Folders of servers still running, and
anything else in the temp directory, are left alone.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "embed-"
MARKER = "in-use"

# This process's open markers: closing one would drop its lock.
_held: list[int] = []


def create_run_folder() -> Path:
    """A new run folder, held by this process, after removing those left behind. Where the
    temporary directory takes no locks, the folder has no marker: it is never removed but
    by its own server's clean stop, as before."""
    if removed := remove_abandoned():
        log.info("removed %d run folders left by servers that were killed", removed)
    folder = Path(tempfile.mkdtemp(prefix=PREFIX))
    # Locked before it appears under its name: a server starting meanwhile never sees the
    # marker unheld.
    staging = folder / f".{MARKER}"
    try:
        _lock(os.open(staging, os.O_RDWR | os.O_CREAT, 0o600))
    except OSError as exc:
        log.warning("no lock in %s (%s): a killed server's folder stays there", folder, exc)
        return folder
    os.rename(staging, folder / MARKER)
    return folder


def hold(folder: Path) -> None:
    """Mark `folder` in use by this process too, until it exits: in each of the server's
    child processes (the supervisor holds it meanwhile). Nothing where it has no marker."""
    try:
        _lock(os.open(folder / MARKER, os.O_RDONLY))
    except OSError:
        return


def _lock(descriptor: int) -> None:
    fcntl.flock(descriptor, fcntl.LOCK_SH)
    _held.append(descriptor)


def remove_abandoned() -> int:
    """Remove the run folders whose marker no process holds; how many. Only this user's own
    folders, and only a marker that is a plain file: anyone may write in /tmp."""
    removed = 0
    for marker in Path(tempfile.gettempdir()).glob(f"{PREFIX}*/{MARKER}"):
        folder = marker.parent
        try:
            owned = folder.lstat()
            descriptor = os.open(marker, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # removed meanwhile, another user's, or not a file
            continue
        try:
            found = os.fstat(descriptor)
            if not (
                stat.S_ISDIR(owned.st_mode)
                and stat.S_ISREG(found.st_mode)
                and owned.st_uid == found.st_uid == os.geteuid()
            ):
                continue
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held (its server runs), or it cannot tell
            continue
        finally:
            os.close(descriptor)
        shutil.rmtree(folder, ignore_errors=True)
        removed += not folder.exists()
    return removed
