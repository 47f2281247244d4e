"""Keeping the process's memory flat under sustained load (glibc's malloc).

glibc gives every thread that allocates its own arena (up to 8 per core), and returns freed
memory to the system only from the top of each heap. With an event loop, a worker, tokenizer
and rendering threads each freeing large JSON bodies and arrays, RSS then climbs for minutes
without a leak. Two arenas, and a trim between batches (at most once a second), keep it flat
(`python -m bench.soak` checks; docs/benchmarks.md). Elsewhere than glibc both calls are skipped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time

log = logging.getLogger(__name__)

_M_ARENA_MAX = -8  # mallopt parameter number, from glibc's malloc.h
# Idle trims at most this often: a trim walks the heaps, which costs milliseconds.
TRIM_INTERVAL = 1.0


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


_LIBC = _libc()


def limit_arenas(arenas: int = 2) -> None:
    """Cap malloc's arenas, before the threads start; MALLOC_ARENA_MAX, if set, wins."""
    if _LIBC is None or "MALLOC_ARENA_MAX" in os.environ:
        return
    if not _LIBC.mallopt(_M_ARENA_MAX, arenas):
        log.warning("mallopt(M_ARENA_MAX, %d) failed", arenas)


class Trimmer:
    """Returns freed heap memory to the system, at most once per TRIM_INTERVAL."""

    def __init__(self) -> None:
        self._last = 0.0

    def maybe_trim(self) -> None:
        now = time.monotonic()
        if _LIBC is None or now - self._last < TRIM_INTERVAL:
            return
        self._last = now
        _LIBC.malloc_trim(0)
