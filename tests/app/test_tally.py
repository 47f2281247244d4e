"""The per-request figures held in plain Python (app/tally.py): flushed, they read exactly as
prometheus_client's own writes would, and they are flushed when due."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from app.tally import Tally

pytestmark = pytest.mark.anyio
BUCKETS = (0.001, 0.01, 0.1, 1.0, 10.0)


def families(registry: CollectorRegistry) -> tuple[Counter, Histogram]:
    counter = Counter("c", "A counter.", ["route"], registry=registry)
    histogram = Histogram("h", "A histogram.", ["model"], buckets=BUCKETS, registry=registry)
    return counter, histogram


def exposition(registry: CollectorRegistry) -> dict[str, float]:
    """Each sample's value by its name and labels (the `_created` times left out)."""
    text = generate_latest(registry).decode()
    samples = (line.rpartition(" ") for line in text.splitlines() if not line.startswith("#"))
    return {name: float(value) for name, _, value in samples if "_created" not in name}


def test_a_flush_reads_as_each_figure_written_at_once() -> None:
    rng = random.Random(0)
    # Values on the bounds too: a value equal to a bound belongs to that bound's bucket.
    values = [rng.choice([*BUCKETS, rng.uniform(0, 20), 0.0]) for _ in range(500)]
    direct, tallied = CollectorRegistry(), CollectorRegistry()
    (counter, histogram), (held_counter, held_histogram) = families(direct), families(tallied)
    tally = Tally()
    for index, value in enumerate(values):
        route = "/embed" if index % 3 else "/rerank"
        counter.labels(route).inc(index % 4)
        histogram.labels("m").observe(value)
        tally.count(held_counter.labels(route), index % 4)
        tally.observe(held_histogram.labels("m"), value)
        if index == 250:  # two flushes add up
            tally.flush()
    tally.flush()
    held, written = exposition(tallied), exposition(direct)
    assert held.keys() == written.keys()
    for sample, value in written.items():  # sums added in another order: rounding apart
        assert held[sample] == pytest.approx(value, rel=1e-12), sample
    assert written['h_count{model="m"}'] == 500.0


async def test_figures_wait_for_a_flush_and_the_timer_flushes_them() -> None:
    registry = CollectorRegistry()
    counter, histogram = families(registry)
    tally = Tally(interval=0.05)
    tally.count(counter.labels("/embed"), 2)
    tally.observe(histogram.labels("m"), 0.5)
    assert registry.get_sample_value("c_total", {"route": "/embed"}) == 0.0
    assert registry.get_sample_value("h_count", {"model": "m"}) == 0.0
    await asyncio.sleep(0.2)
    assert registry.get_sample_value("c_total", {"route": "/embed"}) == 2.0
    assert registry.get_sample_value("h_bucket", {"model": "m", "le": "1.0"}) == 1.0
    assert registry.get_sample_value("h_sum", {"model": "m"}) == 0.5


def test_without_an_event_loop_the_first_figure_past_the_interval_flushes() -> None:
    registry = CollectorRegistry()
    counter, _ = families(registry)
    tally = Tally(interval=0.05)
    tally.count(counter.labels("/embed"))
    tally.count(counter.labels("/embed"))
    assert registry.get_sample_value("c_total", {"route": "/embed"}) == 0.0
    time.sleep(0.1)
    tally.count(counter.labels("/embed"))  # held past the interval: all three are written
    assert registry.get_sample_value("c_total", {"route": "/embed"}) == 3.0


async def test_the_last_request_to_end_writes_what_is_held() -> None:
    registry = CollectorRegistry()
    counter, _ = families(registry)
    tally = Tally(interval=60.0)
    tally.begin()
    tally.begin()
    tally.count(counter.labels("/embed"))
    tally.end()  # one request is still in progress
    assert registry.get_sample_value("c_total", {"route": "/embed"}) == 0.0
    tally.end()
    assert registry.get_sample_value("c_total", {"route": "/embed"}) == 1.0
