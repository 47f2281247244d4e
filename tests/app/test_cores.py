"""The cores workers share (app/cores.py): a lone pass takes them all, nothing waits for cores
nobody uses, and a worker's death leaves nothing behind that could block the others. Workers
are played by threads of this process (each lease opens the lock file on its own), and by a
process killed mid-pass."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

import pytest
import torch

from app import cores
from app.cores import RECENTLY_BUSY, CoreLease, CorePool
from app.engine.model_engine import ModelEngine
from app.metrics import Metrics
from model import Embedder
from tests.app.conftest import make_settings

# Long enough for a thread that should block to have got through, were it not blocked.
BLOCKED_FOR = 0.3


@pytest.fixture
def pool(tmp_path: Path) -> CorePool:
    return CorePool(multiprocessing.get_context("spawn"), workers=2, share=1, folder=tmp_path)


def hold(lease: CoreLease, entered: Future[int], leave: threading.Event) -> None:
    """A worker's batch, as its batcher runs one: busy, then a pass until `leave` is set."""
    lease.set_busy(True)
    with lease.cores() as taken:
        entered.set_result(taken)
        leave.wait()
    lease.set_busy(False)


def test_a_lone_pass_takes_every_core(pool: CorePool) -> None:
    assert pool.size == 2  # 2 workers with 1 thread each, on a machine with at least 2 CPUs
    with CoreLease(pool, 0).cores() as taken:
        assert taken == 2


def test_a_worker_with_queued_inputs_keeps_the_others_from_going_wide(pool: CorePool) -> None:
    # As while it waits for a fuller batch: it will want its share within milliseconds.
    first, second = CoreLease(pool, 0), CoreLease(pool, 1)
    second.set_busy(True)
    with first.cores() as taken:
        assert taken == 1
    second.set_busy(False)
    time.sleep(RECENTLY_BUSY * 2)
    with first.cores() as taken:
        assert taken == 2


def test_a_worker_busy_a_moment_ago_still_keeps_the_others_from_going_wide(
    pool: CorePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its event loop is answering its last batch's clients, who come straight back.
    monkeypatch.setattr(cores, "RECENTLY_BUSY", BLOCKED_FOR)
    first, second = CoreLease(pool, 0), CoreLease(pool, 1)
    second.set_busy(True)
    second.set_busy(False)
    second.set_busy(False)  # as each later change of an empty queue says: the grace stays
    with first.cores() as taken:
        assert taken == 1
    time.sleep(BLOCKED_FOR)
    with first.cores() as taken:
        assert taken == 2


def test_a_pass_waits_for_a_wide_one_and_then_both_run_on_their_share(pool: CorePool) -> None:
    first, second = CoreLease(pool, 0), CoreLease(pool, 1)
    wide, narrow = Future[int](), Future[int]()
    leave_wide, leave_narrow = threading.Event(), threading.Event()
    with ThreadPoolExecutor(2) as threads:
        threads.submit(hold, first, wide, leave_wide)
        assert wide.result(timeout=5) == 2
        threads.submit(hold, second, narrow, leave_narrow)
        with pytest.raises(TimeoutError):
            narrow.result(timeout=BLOCKED_FOR)
        leave_wide.set()
        assert narrow.result(timeout=5) == 1
        # The first worker's next pass, beside the second's, takes its share at once.
        with first.cores() as taken:
            assert taken == 1
        leave_narrow.set()


def die_mid_pass(pool: CorePool, index: int, entered: EventType) -> None:
    """In a child process: take every core, then die by SIGKILL holding them."""
    lease = CoreLease(pool, index)
    lease.set_busy(True)
    with lease.cores():
        entered.set()
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_killed_mid_pass_blocks_nobody(pool: CorePool) -> None:
    context = multiprocessing.get_context("spawn")
    entered = context.Event()
    child = context.Process(target=die_mid_pass, args=(pool, 0, entered))
    child.start()
    child.join(30)
    assert entered.is_set() and child.exitcode == -signal.SIGKILL
    living = CoreLease(pool, 1)

    def one_pass() -> int:
        with living.cores() as taken:
            return taken

    with ThreadPoolExecutor(1) as thread:
        # The kernel dropped the dead worker's lock (else this waits for ever); its number
        # still says busy, so the pass takes its share.
        assert thread.submit(one_pass).result(timeout=5) == 1
        pool.forget(0)  # what the supervisor does when a worker exits
        assert thread.submit(one_pass).result(timeout=5) == 2


def test_an_engine_loads_on_every_core_a_pass_may_take_and_runs_on_its_share(
    pool: CorePool, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MKL lays a weight out for the threads that pack it (model/prepacked.py): the model is
    loaded on as many threads as a lone pass takes, and the engine then runs (from its
    warm-up on) on its share; compiled passes (`compile`) are compiled for both counts."""
    assert pool.size == 2  # more cores than the engine's own thread
    settings = make_settings(tiny_checkpoint, threads=1)
    engine = ModelEngine(
        settings, settings.models()[0], Metrics().of("tiny"), "cpu", CoreLease(pool, 0), None
    )
    threads_at: dict[str, int] = {}
    compiled_for: list[set[int]] = []
    load, warm_up = Embedder.load, ModelEngine._warm_up

    def loading(*args: Any, **kwargs: Any) -> Embedder:
        threads_at["load"] = torch.get_num_threads()
        return load(*args, **kwargs)

    def warming(embedder: Embedder, thread_counts: set[int]) -> float:
        threads_at["warm-up"] = torch.get_num_threads()
        compiled_for.append(thread_counts)
        return warm_up(embedder, thread_counts)

    monkeypatch.setattr(Embedder, "load", loading)
    monkeypatch.setattr(ModelEngine, "_warm_up", staticmethod(warming))
    engine.load(lambda deliveries: None)
    engine.stop()
    assert threads_at == {"load": 2, "warm-up": 1}
    assert compiled_for == [{1, 2}]
