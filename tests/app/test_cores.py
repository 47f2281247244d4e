"""The cores workers share (app/cores.py): a lone pass takes them all, and nothing waits for
cores nobody uses. Two workers are played by two threads of this process."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from app.cores import WAITING, CoreLease, CorePool

# Long enough for a thread that should block to have got through, were it not blocked.
BLOCKED_FOR = 0.3


@pytest.fixture(autouse=True)
def keep_torch_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def pool() -> CorePool:
    return CorePool(multiprocessing.get_context("spawn"), workers=2, share=1)


def hold(lease: CoreLease, entered: Future[int], leave: threading.Event) -> None:
    """A pass that runs until `leave` is set; `entered` gets the cores it took."""
    with lease.cores() as taken:
        entered.set_result(taken)
        leave.wait()


def test_a_lone_pass_takes_every_core_and_runs_on_as_many_threads(pool: CorePool) -> None:
    with CoreLease(pool, 0).cores() as taken:
        assert taken == 2
        assert torch.get_num_threads() == 2
        assert list(pool.held) == [2, 0]
    assert list(pool.held) == [0, 0]


def test_a_pass_waits_for_a_wide_one_then_takes_only_its_share(pool: CorePool) -> None:
    first, second = CoreLease(pool, 0), CoreLease(pool, 1)
    wide, narrow = Future[int](), Future[int]()
    leave_wide, leave_narrow = threading.Event(), threading.Event()
    with ThreadPoolExecutor(2) as threads:
        threads.submit(hold, first, wide, leave_wide)
        assert wide.result(timeout=5) == 2
        threads.submit(hold, second, narrow, leave_narrow)
        with pytest.raises(TimeoutError):
            narrow.result(timeout=BLOCKED_FOR)
        assert list(pool.held) == [2, WAITING]
        leave_wide.set()
        # It waited: under load, the workers go back to running side by side.
        assert narrow.result(timeout=5) == 1
        # And a pass beside it takes the one core left, at once.
        with first.cores() as taken:
            assert taken == 1
            assert torch.get_num_threads() == 1
            assert list(pool.held) == [1, 1]
        leave_narrow.set()
    assert list(pool.held) == [0, 0]


def test_a_waiting_worker_keeps_the_others_from_going_wide(pool: CorePool) -> None:
    pool = CorePool(multiprocessing.get_context("spawn"), workers=3, share=1)
    leases = [CoreLease(pool, index) for index in range(3)]
    entered = [Future[int]() for _ in range(3)]
    leave = [threading.Event() for _ in range(3)]
    with ThreadPoolExecutor(3) as threads:
        threads.submit(hold, leases[0], entered[0], leave[0])
        assert entered[0].result(timeout=5) == 3
        threads.submit(hold, leases[1], entered[1], leave[1])
        with pytest.raises(TimeoutError):
            entered[1].result(timeout=BLOCKED_FOR)
        leave[0].set()
        assert entered[1].result(timeout=5) == 1
        # Worker 0 is idle, worker 1 runs: a third pass takes its share, not the two free.
        threads.submit(hold, leases[2], entered[2], leave[2])
        assert entered[2].result(timeout=5) == 1
        leave[1].set()
        leave[2].set()


def test_the_cores_of_a_dead_worker_are_freed_for_the_others(pool: CorePool) -> None:
    dead, living = CoreLease(pool, 0), CoreLease(pool, 1)
    wide, narrow = Future[int](), Future[int]()
    never, leave = threading.Event(), threading.Event()
    with ThreadPoolExecutor(2) as threads:
        threads.submit(hold, dead, wide, never)  # stands for a worker killed mid-pass
        assert wide.result(timeout=5) == 2
        threads.submit(hold, living, narrow, leave)
        with pytest.raises(TimeoutError):
            narrow.result(timeout=BLOCKED_FOR)
        pool.forget(0)  # what the supervisor does when a worker exits
        assert narrow.result(timeout=5) == 1
        leave.set()
        never.set()
