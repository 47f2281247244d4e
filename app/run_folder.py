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
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "embed-"
MARKER = "in-use"

# This process's open markers: closing one would drop its lock.
_held: list[int] = []


def create_run_folder() -> Path:
    """A new run folder, held by this process, after removing those left behind."""
    if removed := remove_abandoned():
        log.info("removed %d run folders left by servers that were killed", removed)
    folder = Path(tempfile.mkdtemp(prefix=PREFIX))
    # Locked before it appears under its name: a server starting meanwhile never sees the
    # marker unheld.
    staging = folder / f".{MARKER}"
    _lock(os.open(staging, os.O_RDWR | os.O_CREAT, 0o600))
    os.rename(staging, folder / MARKER)
    return folder


def hold(folder: Path) -> None:
    """Mark `folder` in use by this process too, until it exits: in each of the server's
    child processes (the supervisor holds it meanwhile)."""
    _lock(os.open(folder / MARKER, os.O_RDONLY))


def _lock(descriptor: int) -> None:
    fcntl.flock(descriptor, fcntl.LOCK_SH)
    _held.append(descriptor)


def remove_abandoned() -> int:
    """Remove the run folders whose marker no process holds; how many."""
    removed = 0
    for marker in Path(tempfile.gettempdir()).glob(f"{PREFIX}*/{MARKER}"):
        try:
            descriptor = os.open(marker, os.O_RDONLY)
        except OSError:  # removed meanwhile, or another user's
            continue
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its server runs
            continue
        else:
            shutil.rmtree(marker.parent, ignore_errors=True)
            removed += 1
        finally:
            os.close(descriptor)
    return removed
