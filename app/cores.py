"""Sharing the CPU's cores among engines on one CPU (`--devices cpu,cpu`), here called
workers, as they were first built: a lone pass takes them all.

Each worker's share is `threads` (by default the CPUs over the workers): one-thread passes
side by side give the most throughput on a small machine, but a request alone would run on
one core while the others idle (docs/benchmarks.md). So each forward pass runs on as many
torch threads as it can take:
- all the workers' (at most the CPUs), when no other worker is busy (a batch running, or
  waiting for cores, or inputs in its queue, as while it waits for a fuller batch) or was
  within the last RECENTLY_BUSY seconds;
- its share otherwise, waiting for it while a pass that took all runs. A pass that had to
  wait thereby takes only its share, and so does the next pass beside it, so under load
  the workers settle back into running side by side instead of taking turns.
Two shared things carry it: one number per worker, set by its batcher, saying until when it
wants its cores (infinity while busy), in memory the supervisor made; and a lock file, held
shared by a pass on its share and exclusive by a pass on all the cores. A file lock, because
the kernel drops it when its holder dies: a worker killed mid-pass or while waiting (the OOM
killer, say) leaves nothing that could block the others, and the supervisor clears its
number (see app/supervisor.py).
"""

from __future__ import annotations

import ctypes
import fcntl
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.context import SpawnContext
from pathlib import Path

from model.cpus import available_cpus

# A worker whose batch ended this recently still counts as busy. Its event loop is sending
# that batch's answers, on a core, and the clients' next requests come back within
# milliseconds; a pass on all the cores meanwhile would stall at each of its OpenMP barriers
# behind that loop, and hold the worker's next batch waiting for its share. With it, passes
# under a steady load stay on their share, while 1 x 1 (the other worker idle for long) still
# runs on every core; `embed_forward_passes_total{threads}` shows which.
RECENTLY_BUSY = 0.01


class CorePool:
    """The shared part, made by the supervisor and handed to each worker at spawn."""

    def __init__(self, context: SpawnContext, workers: int, share: int, folder: Path) -> None:
        """`folder`: where the lock file goes (the server's run folder)."""
        self.share = share
        self.size = max(share, min(share * workers, available_cpus()))
        # Per worker, until when (time.monotonic(), the same clock in every process) it wants
        # its cores: infinity while busy, 0 when it never was or has died.
        self.wanted_until: ctypes.Array[ctypes.c_double] = context.RawArray(
            ctypes.c_double, workers
        )
        self.lock_path = folder / "cores.lock"
        self.lock_path.touch()

    def forget(self, index: int) -> None:
        """A dead worker wants no cores: the others may take them all again."""
        self.wanted_until[index] = 0.0


class CoreLease:
    """One worker's side: `set_busy` from its batcher, and `with lease.cores():` around each
    forward pass. No torch here: the supervisor makes the pool and never imports it."""

    def __init__(self, pool: CorePool, index: int) -> None:
        self.pool = pool
        self.index = index
        # Opened by each worker: locks on separate opens exclude each other.
        self._lock_file = os.open(pool.lock_path, os.O_RDWR)

    def set_busy(self, busy: bool) -> None:
        """Whether this worker runs a batch or holds inputs: it wants cores now or soon."""
        wanted_until = self.pool.wanted_until
        if busy:
            wanted_until[self.index] = math.inf
        elif wanted_until[self.index] == math.inf:  # only as it turns idle: the grace starts
            wanted_until[self.index] = time.monotonic() + RECENTLY_BUSY

    @contextmanager
    def cores(self) -> Iterator[int]:
        """Hold this many cores for one forward pass; the caller runs it on as many threads."""
        taken = self.pool.size if self._take_all() else self._take_share()
        try:
            yield taken
        finally:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)

    def _take_all(self) -> bool:
        wanted_until, now = self.pool.wanted_until, time.monotonic()
        if any(wanted_until[i] > now for i in range(len(wanted_until)) if i != self.index):
            return False
        try:  # fails at once while any other pass holds its share
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def _take_share(self) -> int:
        fcntl.flock(self._lock_file, fcntl.LOCK_SH)  # waits while a pass holds all the cores
        return self.pool.share
