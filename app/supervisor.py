"""The split placement: engine processes (one per device) behind front-end processes.

The supervisor (this module, in the process the container runs; it never imports torch)
reserves the port, starts the engines and waits until each has loaded its model and sent
its card, then starts the front ends, which each listen on the port (see `bind`) and reach
every engine over a Unix socket (app/engine/remote.py, app/engine/process.py).

Stopping: SIGTERM or SIGINT to the supervisor goes on to the front ends, which drain as one
server alone does (app/server.py); once they have exited, the engines finish what is queued
and exit, and so does the supervisor, with 0. A second signal ends the front ends at once. The
children stop on the supervisor's word only (app/stop_signal.py), so that a SIGTERM sent to
every process at once (systemd's default) drains once.

Failures, so that an orchestrator never sees a half-serving container as healthy: an engine
that dies closes its connections, so every front end's /live turns 503 and its requests
fail; the front ends are stopped and the supervisor exits non-zero; a front end that dies
stops everything the same way.

Metrics go through prometheus_client's multiprocess mode: every process writes its values
to files in a directory made here, and whichever front end answers /metrics reports them
all. Engines on one CPU hold their weights once, in a file made here
(model/shared_weights.py), and share its cores (app/cores.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_any
from multiprocessing.context import SpawnContext, SpawnProcess
from pathlib import Path
from types import FrameType

from app.balance import ConnectionBalance, Counts
from app.cores import CoreLease, CorePool
from app.engine.state import EngineBoard
from app.logs import configure_logging
from app.memory import limit_arenas
from app.metrics import MULTIPROCESS_DIR_VARIABLE
from app.run_folder import create_run_folder, hold
from app.settings import ServedModel, Settings
from app.stop_signal import OUTSIDE_STOPS, SUPERVISOR_STOP, leave_stops_to_the_supervisor
from model.codec import ModelCard
from model.errors import ConfigError

log = logging.getLogger("app")

# Seconds a process gets to exit after its signal before it is killed: the longest a drain
# may take, plus uvicorn's close and the batch worker's stop.
STOP_MARGIN = 10.0
_PR_SET_PDEATHSIG = 1  # from linux/prctl.h
_PR_SET_NAME = 15
# Exit codes (multiprocessing's) of a child that a stop signal killed while it started: the
# supervisor's, or one sent to every process at once.
STARTING_STOPPED = (-SUPERVISOR_STOP, *(-sig for sig in OUTSIDE_STOPS))


def bind(
    settings: Settings, *, listen: bool, share: bool = True, reuse_address: bool = True
) -> socket.socket:
    """A socket on the port; shared (SO_REUSEPORT), each front end listens on one of its
    own, and the kernel spreads new connections over them one by one, by a hash of the
    addresses. (On one shared socket, whichever front end's loop woke first took a whole
    burst of connections.) SO_REUSEADDR unless told otherwise: a server started again binds
    while its last run's connections linger (TIME_WAIT)."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    if reuse_address:
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
    """The port, checked and held for the front ends. Bound unshared first: SO_REUSEPORT
    alone would let this server join another one of the same user on the port, unnoticed.
    Then held shared and never listening, so that the kernel sends it no connection, and
    without SO_REUSEADDR: two sockets with it, neither listening, may share a port, so
    another server's check would pass while this one's engines load."""
    bind(settings, listen=False, share=False).close()
    return bind(settings, listen=False, reuse_address=False)


@dataclass(frozen=True)
class Shared:
    """What the supervisor makes for its children: a folder per served model (its engines'
    sockets, their board and, for engines on one CPU, the weights' file), the CPU's cores
    shared by every engine on it, the front ends' connection counts."""

    run_dir: Path
    engines: int  # per model, one per device
    cores: CorePool | None
    share_weights: bool
    counts: Counts

    def model_dir(self, model: int) -> Path:
        return self.run_dir / f"model-{model}"

    def board_path(self, model: int) -> Path:
        return self.model_dir(model) / "board"

    def weights_dir(self, model: int) -> Path | None:
        return self.model_dir(model) / "weights" if self.share_weights else None

    def prepare(self, models: int) -> None:
        """The folders and boards, before any child starts."""
        for model in range(models):
            self.model_dir(model).mkdir()
            if (weights := self.weights_dir(model)) is not None:
                weights.mkdir()
            EngineBoard.create(self.board_path(model), self.engines)


def supervise(settings: Settings) -> int:
    """Serve with engines and front ends until they stop; return the exit code."""
    try:
        reservation = reserve(settings)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc.strerror)
        return 1
    run_dir = create_run_folder()
    metrics_dir = run_dir / "metrics"
    metrics_dir.mkdir()
    # Set before the children start: prometheus_client picks its value store at import.
    os.environ[MULTIPROCESS_DIR_VARIABLE] = str(metrics_dir)
    context = multiprocessing.get_context("spawn")
    devices = settings.devices
    models = len(settings.models())
    cpu_engines = sum(1 for device in devices if not device.startswith("cuda")) * models
    engines = settings.engine_count()
    shared = Shared(
        run_dir,
        len(devices),
        CorePool(context, engines, settings.engine_threads(), run_dir) if cpu_engines > 1 else None,
        sum(1 for device in devices if not device.startswith("cuda")) > 1,
        context.RawArray(ctypes.c_int, settings.frontend_count()),
    )
    shared.prepare(models)
    try:
        return Supervisor(settings, context, shared).run()
    finally:
        reservation.close()
        shutil.rmtree(run_dir, ignore_errors=True)


class Supervisor:
    def __init__(self, settings: Settings, context: SpawnContext, shared: Shared) -> None:
        self.settings = settings
        self.context = context
        self.shared = shared
        self.engines: list[SpawnProcess] = []
        self.frontends: list[SpawnProcess] = []
        # Set by a signal, or by a child exiting on its own: every exit after it is expected.
        self.stopping = threading.Event()
        self.code = 0

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._forward) for sig in OUTSIDE_STOPS}
        try:
            cards = self._start_engines()
            if cards is None or self.stopping.is_set():
                stop_children(self.engines)
                return self.code
            self._start_frontends(cards)
            self._wait()
            return self.code
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _forward(self, sig: int, frame: FrameType | None) -> None:
        """A stop signal (SIGTERM, or SIGINT): the front ends drain (the engines once they
        are gone; before there are front ends, the engines stop at once); a second one ends
        the front ends at once, and the supervisor's exit says 128 + its number. Passed on as
        SUPERVISOR_STOP, of which a child still starting dies quietly (SIGINT would raise
        KeyboardInterrupt in whatever it imports and exit 1)."""
        if self.stopping.is_set():
            self.code = self.code or 128 + sig
        self.stopping.set()
        for process in self.frontends or self.engines:
            _tell_to_stop(process)

    def _start_engines(self) -> list[ModelCard] | None:
        """Every model's engines loaded and warmed up: each model's card (the same from
        each of its engines), or None when one failed (logged with its model's name, exit
        code set)."""
        links: list[Connection] = []
        served = self.settings.models()
        for model, each in enumerate(served):
            for index, device in enumerate(self.settings.devices):
                receiving, sending = self.context.Pipe(duplex=False)
                process = self.context.Process(
                    target=run_engine,
                    args=(self.settings, each, model, index, device, self.shared, sending),
                    name=f"engine-{index}" if len(served) == 1 else f"engine-{model}-{index}",
                )
                process.start()
                sending.close()
                self.engines.append(process)
                links.append(receiving)
                if self.stopping.is_set():  # `_forward` ran before it was listed
                    _tell_to_stop(process)
        cards: list[ModelCard] = []
        for number, (process, link) in enumerate(zip(self.engines, links, strict=True)):
            wait_for_any([link, process.sentinel])
            try:
                kind, value = link.recv()
            except EOFError:  # it died without a word (the OOM killer, say)
                process.join()
                kind, value = "error", f"the engine process exited with {process.exitcode}"
            if self.stopping.is_set():  # stopped while it loaded, as asked
                return None
            name = served[number // self.shared.engines].name
            if kind == "error":
                index = number % self.shared.engines
                log.error(
                    "model %s: engine %d (%s) failed to start: %s", name, index, process.name, value
                )
                # Its own exit code where a signal killed it (128 + N), as after start-up.
                killed = process.exitcode
                self.code = _shell_code(killed) if killed is not None and killed < 0 else 1
                return None
            if number % self.shared.engines == 0:
                cards.append(value)
        return cards

    def _start_frontends(self, cards: list[ModelCard]) -> None:
        for index in range(self.settings.frontend_count()):
            process = self.context.Process(
                target=run_frontend,
                args=(self.settings, cards, index, self.shared),
                name=f"frontend-{index}",
            )
            process.start()
            self.frontends.append(process)
            if self.stopping.is_set():  # `_forward` ran before it was listed
                _tell_to_stop(process)
        log.info(
            "%d engine(s) for %d model(s) on %s, %d front end(s) on %s:%d",
            len(self.engines),
            len(cards),
            ",".join(self.settings.devices),
            len(self.frontends),
            self.settings.host,
            self.settings.port,
        )

    def _wait(self) -> None:
        """Until every child has exited. The front ends go first; the engines follow once
        the last front end has gone. Any exit without a signal stops everything."""
        drain = self.settings.drain_delay + self.settings.shutdown_grace
        running = [*self.frontends, *self.engines]
        while running:
            wait_for_any([process.sentinel for process in running])
            for process in [p for p in running if p.exitcode is not None]:
                running.remove(process)
                self._exited(process, drain)
            if not any(p in running for p in self.frontends):
                stop_children([p for p in self.engines if p in running], drain)

    def _exited(self, process: SpawnProcess, drain: float) -> None:
        if process in self.engines and self.shared.cores is not None:
            self.shared.cores.forget(self.engines.index(process))  # its cores are free
        code = _shell_code(process.exitcode or 0)
        if self.stopping.is_set() and process.exitcode in STARTING_STOPPED:
            # A stop signal killed it before its handler was set: it was still starting (a
            # spawned interpreter has default handlers), so nothing was in flight.
            log.info("%s stopped while it started", process.name)
            code = 0
        self.code = self.code or code
        if not self.stopping.is_set():
            log.error("%s exited with %d: stopping the others", process.name, process.exitcode)
            self.stopping.set()
            self.code = self.code or 1
            stop_children([p for p in self.frontends if p.exitcode is None], drain)


def stop_children(processes: list[SpawnProcess], drain: float = 0.0) -> None:
    """Each child told to stop (a drain of up to `drain` seconds), then waited for; killed
    past its margin."""
    for process in processes:
        _tell_to_stop(process)
    for process in processes:
        process.join(drain + STOP_MARGIN)
        if process.exitcode is None:
            process.kill()


def _tell_to_stop(process: SpawnProcess) -> None:
    """SUPERVISOR_STOP to a child that has not exited."""
    if process.pid is not None and process.exitcode is None:
        with contextlib.suppress(ProcessLookupError):  # exited, not yet reaped
            os.kill(process.pid, SUPERVISOR_STOP)


def _shell_code(exitcode: int) -> int:
    """multiprocessing reports a death by signal N as -N; a shell says 128 + N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def resolve_devices_in_child(devices: list[str]) -> list[str]:
    """What each device names on this machine (`auto` is `cuda` or `cpu`), found in a spawned
    child process (which has this process's import path) so that the supervisor itself never
    imports torch; a device that cannot work raises the child's ConfigError as it was
    raised."""
    spawn = multiprocessing.get_context("spawn")
    # It dies with the supervisor, which a stop signal may end before its handlers are set.
    with ProcessPoolExecutor(1, mp_context=spawn, initializer=_prctl, initargs=(None,)) as pool:
        try:
            return pool.submit(_resolve_devices, devices).result()
        except BrokenProcessPool as exc:
            message = f"devices {devices} could not be checked: the checking process died"
            raise ConfigError(message) from exc


def _resolve_devices(devices: list[str]) -> list[str]:
    """In the child; returns names, so that no torch object travels back."""
    from model.device import resolve_device

    return [str(resolve_device(device)) for device in devices]


def _child(settings: Settings, name: str, run_dir: Path) -> None:
    """What every child does first. Stop signals reach it through the supervisor only (a
    terminal's Ctrl-C goes to the whole process group, systemd's SIGTERM to every process,
    and a child that got one twice would skip its drain); it stops when the supervisor dies;
    `name` is its name in ps and top; it holds the run folder while it lives
    (app/run_folder.py)."""
    os.setpgrp()
    leave_stops_to_the_supervisor()
    _prctl(name)
    hold(run_dir)
    limit_arenas()
    configure_logging(settings.log_level, settings.log_format)
    log.info("%s started (pid %d)", name, os.getpid())


def _prctl(name: str | None) -> None:
    """This child gets SUPERVISOR_STOP when the supervisor dies (at once where it died before
    this could be asked for), and `name` in ps and top."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, SUPERVISOR_STOP)
        if name is not None:
            libc.prctl(_PR_SET_NAME, name.encode())
    except (OSError, AttributeError):  # not Linux: children outlive a killed supervisor
        log.debug("prctl is not available")
        return
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os.kill(os.getpid(), SUPERVISOR_STOP)


def run_engine(
    settings: Settings,
    served: ServedModel,
    model: int,
    index: int,
    device: str,
    shared: Shared,
    ready: Connection,
) -> None:
    """Model `model`'s engine on its `index`th device."""
    _child(settings, "embed-engine", shared.run_dir)
    # Imported here only: the supervisor and the front ends never import torch.
    from app.engine.process import EngineProcess
    from model.shared_weights import WeightStore

    lease = model * shared.engines + index  # the CPU's cores are every engine's
    cores = CoreLease(shared.cores, lease) if shared.cores is not None else None
    folder = shared.weights_dir(model)
    weights = WeightStore(folder) if folder is not None else None
    board = EngineBoard(shared.board_path(model), shared.engines)
    engine = EngineProcess(
        settings.for_model(served),
        served,
        index,
        device,
        shared.model_dir(model),
        board,
        cores,
        weights,
    )
    raise SystemExit(engine.run(ready))


def run_frontend(settings: Settings, cards: list[ModelCard], index: int, shared: Shared) -> None:
    _child(settings, "embed-frontend", shared.run_dir)
    from app.engine.protocol import Admission
    from app.engine.remote import RemoteEngine
    from app.server import serve

    engines = {}
    for model, (served, card) in enumerate(zip(settings.models(), cards, strict=True)):
        own = settings.for_model(served)
        engines[served.name] = RemoteEngine(
            card,
            shared.model_dir(model),
            EngineBoard(shared.board_path(model), shared.engines),
            Admission(own.request_timeout, own.max_queue_wait),
        )
    balance = ConnectionBalance(shared.counts, index)
    sock = bind(settings, listen=True)
    raise SystemExit(serve(settings, engines, sock, balance, supervised=True))
