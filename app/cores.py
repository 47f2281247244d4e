"""Sharing the CPU's cores among the workers (--workers on a CPU): a lone pass takes them all.

Each worker's share is `threads` (by default the CPUs over the workers): one-thread passes
side by side give the most throughput on a small machine, but a request alone would run on
one core while the others idle (1 x 1 p50 1.1-1.7x one worker's, measured by bench/workers.py
before this lease). So every forward pass first takes cores from a pool that all workers
share, and runs on as many torch threads as it took:
- all of them, when no other worker is running or waiting for a pass: nobody else needs them;
- its share otherwise, waiting for it if a wide pass holds it. A pass that had to wait
  takes only its share, so that under load the workers settle back into running side by
  side instead of taking turns at wide passes.
The cores a worker holds sit in memory the supervisor shares with all workers, guarded by
one cross-process condition; the supervisor frees a dead worker's slot (see app/workers.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.context import SpawnContext
from multiprocessing.synchronize import Condition

import torch

# A worker's slot: the cores its running pass holds, or WAITING while it waits for its share.
WAITING = -1
# How long the supervisor tries for the lock when it frees a dead worker's slot: the worker
# may have died holding it, and a stuck supervisor would never stop the others.
FORGET_TIMEOUT = 1.0


class CorePool:
    """The shared part, made by the supervisor and handed to each worker at spawn."""

    def __init__(self, context: SpawnContext, workers: int, share: int) -> None:
        self.share = share
        self.size = share * workers
        self.condition: Condition = context.Condition()
        self.held: ctypes.Array[ctypes.c_int] = context.RawArray(ctypes.c_int, workers)

    def forget(self, index: int) -> None:
        """Free what a dead worker held, so that the others' passes do not wait for it."""
        if self.condition.acquire(timeout=FORGET_TIMEOUT):
            try:
                self.held[index] = 0
                self.condition.notify_all()
            finally:
                self.condition.release()


class CoreLease:
    """One worker's side: `with lease.cores():` around each forward pass, on the thread that
    runs torch (the thread count is per thread)."""

    def __init__(self, pool: CorePool, index: int) -> None:
        self.pool = pool
        self.index = index

    @contextmanager
    def cores(self) -> Iterator[int]:
        taken = self._take()
        if torch.get_num_threads() != taken:
            torch.set_num_threads(taken)
        try:
            yield taken
        finally:
            with self.pool.condition:
                self.pool.held[self.index] = 0
                self.pool.condition.notify_all()

    def _take(self) -> int:
        pool, held = self.pool, self.pool.held
        with pool.condition:
            others = [held[i] for i in range(len(held)) if i != self.index]
            if not any(others):
                held[self.index] = pool.size
                return pool.size
            if pool.size - sum(n for n in others if n > 0) < pool.share:
                held[self.index] = WAITING
                pool.condition.wait_for(lambda: self._free() >= pool.share)
            held[self.index] = pool.share
            return pool.share

    def _free(self) -> int:
        held = self.pool.held
        return self.pool.size - sum(held[i] for i in range(len(held)) if held[i] > 0)
