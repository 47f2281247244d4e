"""One OS thread for all of torch's work: loading, warm-up and every forward pass.

Why one: torch's CPU kernels parallelise with OpenMP (libgomp), which keeps a pool of worker
threads for each thread that starts parallel work. Once it manages more threads than there
are CPUs, it stops spinning between parallel regions and puts its workers to sleep, and each
of the hundreds of regions in a forward pass then pays for waking them. Loading the model in
one thread and running it in another therefore makes every short forward pass markedly slower
(docs/architecture.md); `tests/app/test_compute.py` checks that the service keeps to one
thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
T = TypeVar("T")
Job = tuple[Callable[[], object], "Future[object]"]


class ComputeThreadClosedError(RuntimeError):
    """Work submitted after `close`: nothing will run it."""


class ComputeThread:
    """A daemon thread that runs submitted calls one after another, in order."""

    def __init__(self, threads: int | None = None) -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._closing = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="embed-compute", daemon=True)
        self._thread.start()
        if threads is not None:
            # OpenMP's thread count is a per-thread setting: set it where the work runs.
            self.submit(torch.set_num_threads, threads)

    def submit(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """The call's future; failed at once once the thread is closed (a model still loading
        when the server stops would otherwise wait for it for ever)."""
        future: Future[T] = Future()
        with self._closing:
            if self._closed:
                future.set_exception(ComputeThreadClosedError("the server is stopping"))
            else:
                self._jobs.put((partial(fn, *args, **kwargs), future))  # type: ignore[arg-type]
        return future

    def close(self) -> None:
        """The thread ends after the jobs already submitted; later ones fail."""
        with self._closing:
            self._closed = True
            self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            call, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)
