"""bench.frontend_cost drives a revision's app in a process of its own and reads its figure."""

from __future__ import annotations

from pathlib import Path

from bench.frontend_cost import CALLERS, run_round

ROOT = Path(__file__).resolve().parents[2]


def test_a_round_reads_the_front_ends_cpu_per_request(tiny_checkpoint: Path) -> None:
    """Any request not answered 200 fails the round; every caller got answers, and the CPU
    they cost was counted."""
    done = run_round(ROOT, [], tiny_checkpoint, 0.3)
    assert done.requests > CALLERS and done.us_per_request > 0
