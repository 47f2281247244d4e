"""bench.frontend_cost drives a revision's app in a process of its own and reads its figure."""

from __future__ import annotations

from pathlib import Path

from bench.frontend_cost import run_round

ROOT = Path(__file__).resolve().parents[2]


def test_a_round_reads_the_front_ends_cpu_per_request(tiny_checkpoint: Path) -> None:
    figure = run_round(ROOT, [], tiny_checkpoint, 0.3)
    # Every request went through the app and was answered 200 (else the round fails): a
    # front end's Python takes tens of microseconds per request at the least.
    assert 10 < figure < 100_000
