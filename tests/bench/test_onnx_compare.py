"""bench.onnx_compare's rounds: the engines take turns block by block, each timed alone."""

from __future__ import annotations

import time

import numpy as np
import pytest

from bench import onnx_compare
from bench.onnx_compare import BLOCK_BATCHES, BLOCK_SENTENCES, Timings, one_round


class Clock:
    """A clock that only the fake engines move: each text costs its engine a fixed time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_engines(
    clock: Clock, costs: dict[str, float], calls: list[tuple[str, tuple[str, ...]]]
) -> dict[str, onnx_compare.Encode]:
    def engine(name: str) -> onnx_compare.Encode:
        def encode(texts: list[str]) -> np.ndarray:
            calls.append((name, tuple(texts)))
            clock.now += costs[name] * len(texts)
            return np.zeros((len(texts), 2), dtype=np.float32)

        return encode

    return {name: engine(name) for name in costs}


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(time, "perf_counter", fake)
    return fake


def test_each_engine_is_timed_on_its_own_calls(clock: Clock) -> None:
    calls: list[tuple[str, tuple[str, ...]]] = []
    found = fake_engines(clock, {"fast": 1.0, "slow": 3.0}, calls)
    batches = [[f"b{i}a", f"b{i}b"] for i in range(3 * BLOCK_BATCHES)]
    singles = [f"s{i}" for i in range(2 * BLOCK_SENTENCES)]
    timings = {name: Timings() for name in found}
    for _ in range(2):
        one_round(found, batches, singles, timings)
    assert timings["fast"].texts == timings["slow"].texts == 2 * 2 * len(batches)
    assert timings["fast"].texts_per_s == pytest.approx(1.0)
    assert timings["slow"].texts_per_s == pytest.approx(1 / 3)
    # The untimed call that starts each block of sentences counts in no figure.
    assert len(timings["fast"].single_seconds) == 2 * len(singles)
    assert timings["fast"].single_p50_ms == pytest.approx(1000.0)
    assert timings["slow"].single_p50_ms == pytest.approx(3000.0)


def test_engines_take_turns_block_by_block_in_a_rotating_order(clock: Clock) -> None:
    calls: list[tuple[str, tuple[str, ...]]] = []
    found = fake_engines(clock, {"a": 1.0, "b": 1.0, "c": 1.0}, calls)
    batches = [[f"b{i}"] for i in range(3 * BLOCK_BATCHES)]
    singles = [f"s{i}" for i in range(3 * BLOCK_SENTENCES)]
    one_round(found, batches, singles, {name: Timings() for name in found})
    batch_calls, single_calls = calls[: 3 * len(batches)], calls[3 * len(batches) :]
    # Every engine runs every batch once, a block of them per turn.
    for name in found:
        assert [texts for who, texts in batch_calls if who == name] == [tuple(b) for b in batches]
    turns = [batch_calls[i][0] for i in range(0, len(batch_calls), BLOCK_BATCHES)]
    assert turns == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    # A block of sentences: one untimed call on its first, then each of its sentences.
    block = BLOCK_SENTENCES + 1
    assert single_calls[:block] == [
        ("a", ("s0",)),
        *(("a", (f"s{i}",)) for i in range(BLOCK_SENTENCES)),
    ]
    assert [single_calls[i][0] for i in range(0, len(single_calls), block)] == turns
