"""`--workers N`: N server processes on one port, each with its own event loop and model.

Why: one Python process has one event loop, and past a point that loop, not the model, is
what limits the server (HTTP parsing, validation, tokenizing and JSON rendering all run on
it). N processes run N loops in parallel. On a CPU each worker's share is 1/N of the cores
for torch, and N one-thread models also skip OpenMP's barriers, which a busy neighbour on a
small machine turns into idle time; a pass while the other workers idle takes all the cores
(app/cores.py). On a GPU the workers share the device.

The supervisor (this module, in the process the container runs) reserves the port, spawns
the workers, which each listen on it (see `bind`), and forwards SIGTERM and SIGINT to them, so
each drains as one server alone does (see app/server.py). Metrics go through
prometheus_client's multiprocess mode: each worker writes its values to files in a directory
made here, and whichever worker answers
/metrics reports the sum over all of them. On a CPU the workers hold their weights once, in a
file made here (model/shared_weights.py). A worker that exits on its own (a failed start,
a crash) takes the others down and the supervisor exits non-zero, for the orchestrator to
restart the whole; a container half-serving after a crash would look healthy to it.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.connection import wait as wait_for_any
from multiprocessing.context import SpawnProcess
from pathlib import Path
from types import FrameType

from app.balance import ConnectionBalance, Counts
from app.cores import CoreLease, CorePool
from app.logs import configure_logging
from app.memory import limit_arenas
from app.metrics import MULTIPROCESS_DIR_VARIABLE
from app.settings import Settings
from model.errors import ConfigError

log = logging.getLogger("app")

# Seconds a worker gets to exit after the supervisor's own signal before it is killed:
# the longest a drain may take, plus uvicorn's close and the batch worker's stop.
STOP_MARGIN = 10.0
_PR_SET_PDEATHSIG = 1  # from linux/prctl.h


def bind(settings: Settings, *, listen: bool, share: bool = True) -> socket.socket:
    """A socket on the port; shared (SO_REUSEPORT), each worker listens on one of its own,
    and the kernel spreads new connections over them one by one, by a hash of the addresses.
    (On one shared socket, whichever worker's loop woke first took a whole burst of
    connections: all 32 of a client's pool, in one measured case.)"""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if share:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((settings.host, settings.port))
    except OSError:
        sock.close()
        raise
    if listen:
        sock.listen(2048)
    return sock


def reserve(settings: Settings) -> socket.socket:
    """The port, checked and held for the workers. Bound unshared first: SO_REUSEPORT alone
    would let this server join another one of the same user on the port, unnoticed. Then
    held shared and never listening, so that the kernel sends it no connection."""
    bind(settings, listen=False, share=False).close()
    return bind(settings, listen=False)


def supervise(settings: Settings) -> int:
    """Serve with `settings.workers` processes until they stop; return the exit code."""
    try:
        reservation = reserve(settings)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc.strerror)
        return 1
    metrics_dir = tempfile.mkdtemp(prefix="embed-metrics-")
    # Set before the workers start: prometheus_client picks its value store at import.
    os.environ[MULTIPROCESS_DIR_VARIABLE] = metrics_dir
    context = multiprocessing.get_context("spawn")
    counts = context.RawArray(ctypes.c_int, settings.workers)
    cores = CorePool(context, settings.workers, settings.worker_threads())
    weights_dir = tempfile.mkdtemp(prefix="embed-weights-")
    workers = [
        context.Process(
            target=_run_worker,
            args=(settings, counts, cores, Path(weights_dir), index),
            name=f"worker-{index}",
        )
        for index in range(settings.workers)
    ]
    # Set by a signal, or by a worker exiting on its own: every exit after it is expected.
    stopping = threading.Event()
    signalled: set[int] = set()

    def forward(sig: int, frame: FrameType | None) -> None:
        stopping.set()
        for worker in workers:
            if worker.pid is not None and worker.exitcode is None:
                os.kill(worker.pid, sig)
                signalled.add(worker.pid)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for worker in workers:
            worker.start()
            # A signal before this worker had a pid skipped it in `forward`: pass it on now.
            if stopping.is_set() and worker.pid is not None and worker.pid not in signalled:
                os.kill(worker.pid, signal.SIGTERM)
                signalled.add(worker.pid)
        log.info("%d workers on %s:%d", len(workers), settings.host, settings.port)
        return _wait(workers, stopping, cores, settings.drain_delay + settings.shutdown_grace)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        reservation.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        shutil.rmtree(weights_dir, ignore_errors=True)
        cores.remove()


def _wait(
    workers: list[SpawnProcess], stopping: threading.Event, cores: CorePool, drain_seconds: float
) -> int:
    """Until every worker has exited: the first to exit without a signal stops the rest.
    A dead worker wants no cores any more, so the others' last passes may take every core."""
    running = list(workers)
    code = 0
    while running:
        wait_for_any([worker.sentinel for worker in running])
        for worker in [w for w in running if w.exitcode is not None]:
            running.remove(worker)
            cores.forget(workers.index(worker))
            code = code or _shell_code(worker.exitcode or 0)
            if not stopping.is_set():
                log.error("%s exited with %d: stopping the others", worker.name, worker.exitcode)
                stopping.set()
                code = code or 1
                _stop(running, drain_seconds)
    return code


def _shell_code(exitcode: int) -> int:
    """multiprocessing reports a death by signal N as -N; a shell says 128 + N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def _stop(workers: list[SpawnProcess], drain_seconds: float) -> None:
    for worker in workers:
        worker.terminate()  # SIGTERM: a drain, as for the supervisor's own signal
    for worker in workers:
        worker.join(drain_seconds + STOP_MARGIN)
        if worker.exitcode is None:
            worker.kill()


def check_device_in_child(device: str) -> None:
    """ConfigError unless `device` can work, checked in a spawned child process (which has
    this process's import path) so that the supervisor itself never imports torch; the
    child's ConfigError comes back as it was raised."""
    if device in ("auto", "cpu"):  # always work
        return
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            pool.submit(_check_device, device).result()
        except BrokenProcessPool as exc:
            message = f"device {device!r} could not be checked: the checking process died"
            raise ConfigError(message) from exc


def _check_device(device: str) -> None:
    """In the child; returns nothing, so that no torch object travels back."""
    from model.device import resolve_device

    resolve_device(device)


def _run_worker(
    settings: Settings, counts: Counts, cores: CorePool, weights_dir: Path, index: int
) -> None:
    # Signals reach the workers through the supervisor only: a terminal's Ctrl-C goes to the
    # whole process group, and a worker that got it twice would skip its drain.
    os.setpgrp()
    _die_with_parent()
    limit_arenas()
    # Imported in the worker only (and after the arena cap): the supervisor never runs the
    # app or a model, and torch would cost it about 165 MiB (model/__init__.py).
    from app.server import serve
    from model.shared_weights import WeightStore

    configure_logging(settings.log_level, settings.log_format)
    log.info("worker started (pid %d)", os.getpid())
    balance = ConnectionBalance(counts, index)
    lease = CoreLease(cores, index)
    weights = WeightStore(weights_dir)
    raise SystemExit(serve(settings, bind(settings, listen=True), balance, lease, weights))


def _die_with_parent() -> None:
    """SIGTERM (a drain) when the supervisor dies, even by SIGKILL: no orphaned workers."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the workers outlive a killed supervisor
        log.debug("prctl(PR_SET_PDEATHSIG) is not available")
