"""bench.server's ceiling: a process kept for a round that measures each figure when asked,
and each load's ratio to the ceiling's figure just before and just after it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.server import LOADS, Bracketed, LoadRun, Reference, best_round
from bench.wrk import WrkResult, peak_kib


def test_the_ceiling_process_measures_each_figure_it_is_asked_for(
    tiny_checkpoint: Path,
) -> None:
    args = argparse.Namespace(
        threads=1, device="cpu", model_id=str(tiny_checkpoint), prepack=True, compile=False
    )
    with Reference("float32", args) as reference:
        full = reference.ask("full")
        assert set(full) == {"short", "long", "single_p50_ms", "peak_rss_mib"}
        # Read after its passes, so that their memory counts.
        assert full["peak_rss_mib"] >= 0.97 * peak_kib(reference.process.pid) / 1024
        for load in LOADS:
            figure = reference.ask(load.ceiling)
            assert list(figure) == [load.figure]
            assert figure[load.figure] > 0
    assert reference.process.returncode == 0


def run_of(requests: int, p50_ms: float) -> LoadRun:
    wrk = WrkResult(
        requests=requests, seconds=10.0, bad=0, socket_errors=0, p50_ms=p50_ms, p99_ms=20.0,
        first_bad="", client_cpu_seconds=0.1,
    )  # fmt: skip
    return LoadRun(wrk, 0.1, 0.0, 0.1, 30.0, 0.1, 0.9)


by_name = {load.name: load for load in LOADS}


def test_a_load_is_compared_with_the_mean_of_the_ceiling_around_it() -> None:
    run = run_of(1000, 12.0)
    # 100 requests/s of 32 texts against a ceiling of 3,000 then 5,000 texts/s.
    assert Bracketed(run, 3000.0, 5000.0).ratio(by_name["4 x 32 short"]) == pytest.approx(0.8)
    # A p50 of 12 ms against calls of 8 then 16 ms.
    assert Bracketed(run, 8.0, 16.0).ratio(by_name["1 x 1 short"]) == pytest.approx(1.0)


def test_the_best_round_is_the_fastest_against_its_own_bracket() -> None:
    """Not the most texts/s, nor the lowest p50: the best ratio to the ceiling around it."""
    slow_minute = Bracketed(run_of(800, 10.0), 100.0, 100.0)  # 80 texts/s of 100; p50 0.1x
    fast_minute = Bracketed(run_of(1000, 12.0), 200.0, 200.0)  # 100 of 200; p50 0.06x
    rounds = [slow_minute, fast_minute]
    assert best_round(by_name["32 x 1 short"], rounds) is slow_minute
    assert best_round(by_name["1 x 1 short"], rounds) is fast_minute
